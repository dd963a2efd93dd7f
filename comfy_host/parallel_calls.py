"""Parallel Model on ComfyUI's side: one generation over several GPUs of this machine, each GPU's process holding its
own copy of the model (worker processes, parallel/workers.py, reload it the way ComfyUI loaded it: its
`cached_patcher_init`).
Three ways to split a model call:
- cfg: the step's conditional and unconditional passes (ComfyUI batches them into one call) on different GPUs; this
  process runs the first part through the model as it is, the workers the others, and the outputs are joined.
- sequence: every process runs the whole call with its share of the image tokens (comfy_host/sequence_split.py), and
  this process's output is the call's.
- both: each pass on its own group of processes, which splits its tokens; one output per group is joined.

Where a call cannot be split (one chunk, as with CFG 1; a ControlNet; other nodes' patches in the model; a family
or shape sequence parallelism does not split; what the workers' copies lack) it runs here alone, and the log says
why once. The workers stay up for later prompts: the same model is reused, another one (file, LoRA, settings) is loaded
into the same processes; a worker that dies fails that prompt with a clear error, and the next prompt starts fresh
ones.
"""
import logging

import torch

from comfy.patcher_extension import WrappersMP

from ..families import family_of
from ..parallel.batch_split import join, split_call
from ..parallel.config import MODES, chosen, why_not_groups
from ..parallel.workers import Placement, WorkerDied, WorkerPool
from .worker_reload import ComfyReload
from .comfy_call_options import ATTENTION_OVERRIDE, video_sparsity_of
from .forward_patch import installed_stack
from .quantized_model import RECIPE
from .quantized_state import quantized_modules
from .sequence_split import how_attention_splits, sequence_options, why_not_sequence

log = logging.getLogger("overdrive")
KEY = "overdrive_parallel"
GPUS = 2
PLAIN = (torch.Tensor, int, float, str, bool, type(None), torch.dtype)


def carried(transformer_options: dict) -> dict:
    """What of a call's options travels to the workers: its data, and Overdrive's attention override."""
    override = transformer_options.get(ATTENTION_OVERRIDE)
    kept = {ATTENTION_OVERRIDE: override} if getattr(override, "overdrive_attention", False) else {}
    return {**plain(transformer_options), **kept}


def patch_key(patches: dict) -> tuple:
    """Each weight patch's key, strengths and data, the data by identity: not the patcher's patches_uuid, which the
    clones of a quantized model share across LoRA strengths and files where every LoRA runs beside the 8-bit layers
    (quantized_lora.place_side_paths)."""
    return tuple((key, tuple((entry[0], id(entry[1]), *map(repr, entry[2:])) for entry in entries))
                 for key, entries in sorted(patches.items()))


def plain(value):
    """What of a call's options can travel to another process: data (tensors, numbers, strings and containers of
    them); functions, patches and wrappers stay here."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if _is_plain(v)}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def _is_plain(value) -> bool:
    if isinstance(value, dict):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    return isinstance(value, PLAIN)


class Pools:
    """The one worker pool of this process (a process belongs to one torch.distributed group), kept for the model
    file it was started for."""

    def __init__(self):
        self.pool, self.key = None, None
        self.patches = {}  # the pool's weight patches: kept, so that the ids in its key are not reused

    def get(self, init: tuple, processes: int, cuda: bool, patcher=None) -> WorkerPool:
        """The pool for the model file `init` as `patcher` (the ModelPatcher running the call) runs it: its weight
        patches (LoRA), quantization and Overdrive's compiled forward. Another model, LoRA, strength or setting is
        loaded into the same worker processes (as many GPUs), else fresh ones start."""
        patches = patcher.patches if patcher is not None else {}
        stack = installed_stack(patcher) if patcher is not None else None
        quantize = quantize_recipe(patcher)
        key = (repr(init), processes, cuda, patch_key(patches), stack, repr(quantize))
        if self.pool is not None and self.key == key and self.pool.alive():
            return self.pool
        same_processes = (self.pool is not None and self.pool.placement == Placement(processes, cuda)
                          and self.pool.alive())
        if not same_processes:
            self.close()
        log.info("Overdrive: %s %d worker process(es) for Parallel Model (each loads the model once%s%s%s)",
                 "loading another model into its" if same_processes else "starting", processes - 1,
                 f", with {len(patches)} patched weights" if patches else "",
                 ", quantized as here" if quantize is not None else "",
                 ", compiled as here" if stack is not None else "")
        reload = ComfyReload(init, patches, stack, quantize)
        try:
            self.pool = self.pool.reload(reload) if same_processes else WorkerPool(reload, processes, cuda).start()
        except BaseException:
            self.pool, self.key = None, None  # closed by the pool itself
            raise
        self.key, self.patches = key, dict(patches)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.pool, self.key = None, None


POOLS = Pools()


def why_not_carried(patcher) -> str | None:
    """Why what the ModelPatcher running a call computes with cannot reach the workers (None: it can): its weight
    patches (LoRA), Quantize Model's layers (repeated with its cached decisions), Compile Model's forward and
    attention, and the step cache travel (every process reuses the same steps: the adaptive one measures over them
    all)."""
    if patcher is None:
        return None
    entries = [entry for entries in patcher.patches.values() for entry in entries]
    if any(function is not None for *_, function in entries):
        return "a weight patch applies a function of this process, which its workers cannot run"
    override = patcher.model_options.get("transformer_options", {}).get(ATTENTION_OVERRIDE)
    if override is not None and not getattr(override, "overdrive_attention", False):
        return "another node's attention override, which its workers cannot run"
    if video_sparsity_of(override) is not None:
        return "Sparse Video Attention, whose dense and sparse steps this process sets before each call"
    if quantized_modules(patcher) and quantize_recipe(patcher) is None:
        return "its quantized layers were not made by Quantize Model, which its workers repeat"
    return None


def why_not_with_idle_gpus(patcher, split: str, passes: int, processes: int) -> str | None:
    """The adaptive step cache sums its measure over every process's part (parallel/agreement.py): a CFG split with
    fewer passes than processes leaves some out."""
    stack = installed_stack(patcher) if patcher is not None else None
    family = family_of(patcher.model.diffusion_model) if stack is not None else None
    config = stack.cache_config if stack is not None else None
    if split == "cfg" and passes < processes and config is not None and family is not None \
            and config.for_family(family.step_cache_threshold).measured:
        return (f"the adaptive step cache decides over every GPU's part, and {passes} passes leave some of the "
                f"{processes} GPUs idle")
    return None


def quantize_recipe(patcher) -> tuple | None:
    """How Quantize Model quantized `patcher`'s model (None: it did not), for the workers to do the same."""
    return patcher.get_attachment(RECIPE) if patcher is not None and quantized_modules(patcher) else None


def why_not_split(x, control, transformer_options) -> str | None:
    chunks = len(transformer_options.get("cond_or_uncond") or ())
    if chunks < 2:
        return "the call has one pass (CFG 1, or ComfyUI ran the passes apart)"
    if x.shape[0] % chunks:
        return "its batch does not divide into its passes"
    if control is not None:
        return "a ControlNet's residuals take part in it"
    return None


def why_not_sequence_call(diffusion_model, x, control, transformer_options, processes, c_crossattn, kwargs):
    if control is not None:
        return "a ControlNet's residuals take part in it"
    if any(kwargs.get(name) is not None for name in ("reference_latent", "ref_latents", "context_latents")):
        return "reference latents join its image tokens"
    if kwargs.get("attention_mask") is not None:
        return "an attention mask (its text's padding) takes part in it"
    cross = tuple(t.shape[-2] for t in (c_crossattn, kwargs.get("clip_fea")) if isinstance(t, torch.Tensor))
    return why_not_sequence(diffusion_model, x, processes, transformer_options, cross)


def chosen_split(mode, diffusion_model, x, control, transformer_options, processes, c_crossattn, kwargs) -> tuple:
    """("cfg" | "both" | "sequence", None), or (None, why the call runs here alone). auto: the passes apart where
    there are as many as the processes, else each pass on its own group of processes that splits its tokens, else
    the tokens."""
    return chosen(mode, lambda split: why_not_this_split(split, mode, diffusion_model, x, control,
                                                        transformer_options, processes, c_crossattn, kwargs))


def why_not_this_split(split, mode, diffusion_model, x, control, transformer_options, processes, c_crossattn,
                       kwargs) -> str | None:
    if split == "sequence":
        return why_not_sequence_call(diffusion_model, x, control, transformer_options, processes, c_crossattn, kwargs)
    why = why_not_split(x, control, transformer_options)
    if why is not None:
        return why
    passes = len(transformer_options["cond_or_uncond"])
    if split == "cfg":
        return f"its {passes} passes leave some of the {processes} GPUs idle" \
            if mode == "auto" and passes < processes else None
    return why_not_groups(processes, passes, "passes") or why_not_sequence_call(
        diffusion_model, x, control, transformer_options, processes // passes, c_crossattn, kwargs)


def parallel_apply_model(processes: int, cuda: bool, init: tuple, mode: str = MODES[0]):
    """An APPLY_MODEL wrapper that splits each call over `processes` processes, by its passes or its tokens."""
    told = set()
    unstarted = []  # the workers could not start for this model: it runs on this GPU, without trying again

    def wrapper(executor, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        diffusion_model, patcher = executor.class_obj.diffusion_model, executor.class_obj.current_patcher
        split, reason = (None, unstarted[0]) if unstarted else chosen_split(
            mode, diffusion_model, x, control, transformer_options, processes, c_crossattn, kwargs)
        reason = reason or why_not_carried(patcher) or why_not_with_idle_gpus(
            patcher, split, len(transformer_options.get("cond_or_uncond") or ()), processes)
        if reason is None:
            try:
                pool = POOLS.get(init, processes, cuda, patcher)
            except WorkerDied as error:  # an optimization that cannot start: the generation goes on, on one GPU
                log.warning("Overdrive Parallel Model: the worker processes did not start, so the model runs on one "
                            "GPU (your generation continues). Reason: %s", str(error).splitlines()[0])
                reason = "its worker processes did not start"
                unstarted.append(reason)
        if reason is not None:
            if reason not in told:
                told.add(reason)
                log.info("Overdrive Parallel Model: a call runs on this GPU alone: %s", reason)
            return executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
        passes = len(transformer_options.get("cond_or_uncond") or ())
        if split not in told:
            told.add(split)
            tokens_over = processes // passes if split == "both" else processes
            log.info("Overdrive Parallel Model: %s parallelism over %d processes%s", split, processes,
                     f" ({how_attention_splits(diffusion_model, tokens_over)})" if split != "cfg" else "")

        def local(px, pt, transformer_options, **rest):
            return executor(px, pt, rest.pop("c_concat"), rest.pop("c_crossattn"), None, transformer_options, **rest)
        call = {"c_concat": c_concat, "c_crossattn": c_crossattn, **kwargs}
        if split == "sequence":
            here = sequence_options(transformer_options, diffusion_model)
            there = sequence_options(carried(transformer_options), diffusion_model)
            return pool.run_everywhere((x, t, {**call, "transformer_options": there}),
                                       lambda: local(x, t, transformer_options=here, **call))
        parts = split_call(x, t, {**call, "transformer_options": transformer_options}, passes, min(processes, passes))
        if split == "both":  # process r runs pass r // size with its group, which splits the pass's tokens
            size = processes // passes

            def in_group(part, options):
                px, pt, pk = part
                return px, pt, {**pk, "transformer_options": sequence_options(options, diffusion_model, size)}
            here = in_group(parts[0], transformer_options)
            remote = [in_group(parts[r // size], carried(parts[r // size][2]["transformer_options"]))
                      for r in range(1, processes)]
            outputs = pool.run([here, *remote], local)
            return join(outputs[::size])  # every process of a group holds its pass's whole output
        remote = [(px, pt, {**pk, "transformer_options": carried(pk["transformer_options"])})
                  for px, pt, pk in parts[1:]]
        return join(pool.run([parts[0], *remote], local))
    return wrapper


def parallelize(model, processes: int, cuda: bool, mode: str = MODES[0]):
    """A clone of `model` whose calls split over `processes` processes (GPUs where `cuda`), by `mode`."""
    init = getattr(model, "cached_patcher_init", None)
    if init is None:
        raise ValueError("Parallel Model needs a model ComfyUI loaded from a file (Load Diffusion Model, Load "
                         "Checkpoint): its workers load the same file")
    patched = model.clone()
    patched.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, parallel_apply_model(processes, cuda, init, mode))
    return patched

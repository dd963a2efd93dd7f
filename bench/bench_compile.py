"""GPU benchmark: ComfyUI sampling with eager, the peers (ComfyUI's built-in TorchCompileModel, `builtin`; a plain
torch.compile of the diffusion model, `peer`) and Overdrive's nodes, side by side in one process, same seed.

  python bench/bench_compile.py --arch sdxl --res 1024 --variants eager,peer,overdrive --out bench/results/x.json
  python bench/bench_compile.py --arch flux --res 1024 --variants eager,builtin,overdrive,overdrive+fp8

Reports per variant: first run (includes compiling), s/image (median of --repeats, sampling only), s/step, peak VRAM,
relative error of the final latent vs the first variant and of the first model call (the same input in every
variant: the per-call error), Dynamo graph count. DiT families (--arch flux|qwen_image|wan22|zimage|sd35) are built
from ComfyUI's own classes at their full configuration with random weights and family-shaped random conditioning. Cold compile times are honest: Inductor's caches
are off for the side-by-side variants (`--warm-cache` keeps them on, for the restart measurement).
"""
import argparse
import dataclasses
import itertools
import json
import logging
import os
import statistics
import time
import traceback

import torch

from overdrive.attention.choice import CHOOSER, AttentionConfig
from overdrive.builtin_models import dit
from overdrive.builtin_models.quantized import LAYOUTS
from overdrive.families import registered as dit_families
from overdrive.comfy_host.latents import latent_parts
from overdrive.harness.inprocess import build_dit_model, build_model, conditioning, import_comfy, run_node
from report import (add_speedups, compile_phases, copy_rates, environment, finish, profile_run, sync_sources,
                    write_report)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cprofile_run(run):
    """Host time of one sampling run by function: with a sync per step, host work adds to the GPU's time."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)
    stats.print_callers(10)  # who calls the costliest ten (a blocking copy shows as a slow `to`)
    stats.sort_stats("cumulative").print_stats(40)  # which caller each step's host time sits under


def live_quantized_gib() -> dict:
    """GiB of every quantized layer still alive in the process, by device (after a garbage collection)."""
    import gc

    from overdrive.quantization.gemm import QuantizedGemm
    gc.collect()
    sizes: dict = {}
    for layer in (o for o in gc.get_objects() if issubclass(type(o), QuantizedGemm)):  # type(): no weak proxy deref
        for buffer in layer.buffers():
            sizes[str(buffer.device)] = sizes.get(str(buffer.device), 0) + buffer.numel() * buffer.element_size()
    return {device: round(size / 2**30, 3) for device, size in sizes.items()}


def weights_gib(module, gpu_only: bool = True) -> float:
    """GiB of the diffusion model's weights (on the GPU only, by default) while it samples: the unique storages of its
    module tree's parameters and buffers as loaded (a quantized layer's 8-bit weight and scales included, a float copy
    kept elsewhere not)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def plain(tensor):  # a weight subclass (comfy-kitchen's QuantizedTensor) holds its data in inner tensors
        if not is_traceable_wrapper_subclass(tensor):
            return [tensor]
        return [inner for name in tensor.__tensor_flatten__()[0] for inner in plain(getattr(tensor, name))]
    storages = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        for data in plain(tensor):
            if data.is_cuda or not gpu_only:
                storage = data.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return round(sum(storages.values()) / 2**30, 3)


def add_stream_estimate(row: dict, model_calls: int) -> None:
    """GiB copied to the GPU per model call and what that costs per image over a desktop's PCIe 4.0 x16 link (25 GB/s).
    The lower of two accounts: ComfyUI's (model_size - loaded_size: right under dynamic VRAM, whose layers live in host
    memory between calls, but blind to Quantize Model's 8-bit layers) and the module tree's (weights not on the GPU at
    the first call: right on the classic loader), plus Quantize Model's layers that stay in host memory."""
    streamed = max(min(row["weights_gib_not_loaded"], row["weights_gib_in_tree"] - row["weights_gib_on_gpu"]), 0.0)
    streamed += row.get("quantized_gib_streamed", 0.0)
    row["streamed_gib_per_call"] = round(streamed, 3)
    row["stream_s_per_image_at_25gb_s"] = round(streamed * 2**30 * model_calls / 25e9, 2)


def bench_vae(comfy, latent, repeats, arch):
    """VAE decode of the final latent: ComfyUI's VAE eager vs through OverdriveCompileVAE (same weights). A DiT
    family decodes with its own VAE (Flux's 16-channel autoencoder, Wan's causal video VAE), at full size."""
    from overdrive.harness.inprocess import build_family_vae, build_vae
    vae = build_family_vae(comfy, arch) if arch in dit.FAMILIES else build_vae(comfy)
    rows, reference = [], None
    for variant in ("vae-eager", "vae-overdrive"):
        target = vae if variant == "vae-eager" else run_node("OverdriveCompileVAE", vae=vae)
        rows.append(time_decodes(variant, target, latent, repeats))
        reference = rows[0]["image"] if reference is None else reference
        rows[-1]["rel_err_vs_eager"] = float((rows[-1].pop("image").float() - reference.float()).norm()
                                             / reference.float().norm())
        rows[-1]["vae_dtype"] = str(vae.vae_dtype)
        print(json.dumps(rows[-1]), flush=True)
    rows[1]["speedup_vs_eager"] = round(rows[0]["s_per_decode"] / rows[1]["s_per_decode"], 3)
    return rows


@torch.inference_mode()  # as ComfyUI runs every node (execution.py): with autograd on, a video decode kept its graph
def time_decodes(variant, target, latent, repeats) -> dict:
    """First decode (compiles) and the median of `repeats` more, through ComfyUI's VAE object `target`."""
    sync()
    start = time.perf_counter()
    image = target.decode(latent)
    sync()
    first = time.perf_counter() - start
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        image = target.decode(latent)
        sync()
        times.append(time.perf_counter() - start)
    return {"variant": variant, "first_run_s": round(first, 3), "s_per_decode": round(statistics.median(times), 4),
            "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if torch.cuda.is_available()
            else None, "image": image}


def loaded_from_file(comfy, arch, size, dtype, directory, layout=None):
    """The built-in model of `arch` written to a file in `directory` (once) and loaded through ComfyUI's own loader,
    as Load Diffusion Model (DiTs) or Load Checkpoint (SD1.5, SDXL) loads it: a ModelPatcherDynamic where dynamic VRAM
    is on, which ComfyUI can load again (TorchCompileModel's and Compile Model's switch to the classic loader).
    `layout`: a DiT file in a quantized layout users download (builtin_models/quantized.py), run by ComfyUI's own
    mixed-precision layers."""
    import pathlib

    import comfy.sd
    from overdrive.builtin_models import ensure_checkpoint
    from overdrive.builtin_models.quantized import ensure_quantized_diffusion_model
    directory = pathlib.Path(directory)
    if arch in dit.FAMILIES:
        path = dit.ensure_diffusion_model(arch, size, 0, directory, dtype) if layout is None else \
            ensure_quantized_diffusion_model(arch, size, 0, directory, layout)
        return comfy.sd.load_diffusion_model(str(path))
    path = ensure_checkpoint(arch, size, 0, directory, dtype)
    return comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]


def slow_activations():
    """Until the returned function is called, DiT blocks compile with torch's own tanh-GELU (block_options without
    fast_activations), for the whole of one variant's run."""
    from overdrive import blockwise
    original = blockwise.block_options
    blockwise.block_options = lambda options: dataclasses.replace(original(options), fast_activations=False)
    return lambda: setattr(blockwise, "block_options", original)


def gelu_apart():
    """Until the returned function is called, Quantize Model fuses no MLP (quantization/gelu_fusion.py): fc1 writes
    16 bits and GELU with fc2's input cast runs as an Inductor kernel of its own, for the whole of one variant's run."""
    from overdrive.quantization import gelu_fusion
    original = gelu_fusion.fuse
    gelu_fusion.fuse = lambda tree, layers, dtype: {}
    return lambda: setattr(gelu_fusion, "fuse", original)


def bf16_attention_output():
    """Until the returned function is called, cuDNN's fp8 attention dequantizes its own output to 16 bits
    (attention/e4m3_output.py off: the blocks trace the run-time op), for one variant's run."""
    from overdrive.attention import e4m3_output
    original = e4m3_output.applies
    e4m3_output.applies = lambda q, k, config: False
    return lambda: setattr(e4m3_output, "applies", original)


def without_fa3():
    """Until the returned function is called, the attention chooser has no FlashAttention-3 backend (bf16 or fp8), as
    on a machine without fa3-fwd: the A/B of issue 57's end-to-end targets in one process. Its per-shape choices are
    forgotten on both edges, so neither run reuses the other's."""
    from overdrive.attention import choice
    removed = {name: choice.BACKENDS.pop(name) for name in ("fa3_bf16", "fa3_fp8")}
    choice.CHOOSER.choices.clear()

    def restore():
        choice.BACKENDS.update(removed)
        choice.CHOOSER.choices.clear()
    return restore


def attention_choices(before: dict) -> list:
    """The attention chooser's measurements made since `before` (a snapshot of CHOOSER.reports): at each shape, on the
    model's own inputs, every backend's time and error against SDPA and the one chosen. A shape measured again (its
    choices forgotten, `without_fa3`) counts as new."""
    from overdrive.attention.choice import CHOOSER
    rows = []
    for (q, k, dtype, device, config), made in CHOOSER.reports.items():
        if before.get((q, k, dtype, device, config)) is made:
            continue
        sdpa_ms, measurements, choice = made
        rows.append({"q": list(q), "k": list(k), "dtype": dtype, "mode": config.mode, "max_error": config.max_error,
                     "sdpa_ms": round(sdpa_ms, 4), "choice": choice,
                     "backends": {m.backend: {"failed": m.failed[:200]} if m.failed is not None else
                                  {"ms": round(m.ms, 4), "rel_err": round(m.rel_err, 5)} for m in measurements}})
    return rows


# variant parts that change code for one run
SWITCHES = {"tanh-gelu": slow_activations, "gelu-apart": gelu_apart, "bf16-attention-output": bf16_attention_output,
            "no-fa3": without_fa3}

# variant parts that compile with Overdrive's Compile Model, and its settings for each
COMPILE_OPTIONS = {"overdrive": {}, "overdrive-no-cudagraphs": {"cuda_graphs": False},
                   "overdrive-autotune": {"mode": "max-autotune"}, "overdrive-flat": {"regional": False},
                   "overdrive-no-precompile": {"precompile": False},
                   "overdrive-comfy-attention": {"fast_attention": False}}

# the table printed last: (column, its value in a row)
COLUMNS = [("variant", lambda r: r["variant"]), ("s/image", lambda r: r["s_per_image"]),
           ("s/step", lambda r: r["s_per_step"]), ("speedup", lambda r: r["speedup_vs_eager"]),
           ("first run (s)", lambda r: r["first_run_s"]), ("peak VRAM GiB", lambda r: r["peak_vram_gib"]),
           ("rel err", lambda r: f"{r['rel_err_vs_first_variant']:.2e}"),
           ("call err", lambda r: f"{r['first_call_rel_err']:.2e}"),
           ("graphs", lambda r: r["dynamo_graphs"])]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="sdxl", choices=["sd15", "sdxl", *dit.FAMILIES])
    parser.add_argument("--size", default="full", choices=["full", "quarter", "tiny"])
    parser.add_argument("--layout", choices=LAYOUTS, help="DiTs: load a file stored in this "
                        "quantized layout (its 'eager' is ComfyUI's own fp8 path on it); implies --from-file")
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--width", type=int, help="default: --res")
    parser.add_argument("--frames", type=int, default=33, help="video families: frames of the video")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cfg", type=float, help="default: 7 for SD, the family's usual value for DiTs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="eager,peer,overdrive",
                        help="comma-separated; each '+'-joined from eager, peer, "
                             "overdrive[-no-cudagraphs|-autotune|-flat|-no-precompile], "
                             "int8, fp8, deepcache, e.g. overdrive+fp8+deepcache")
    parser.add_argument("--cache-interval", type=int, default=3, help="DeepCache interval for '+deepcache' variants")
    parser.add_argument("--cache-threshold", type=float, default=0.1, help="threshold for '+adaptive' variants")
    parser.add_argument("--cache-start", type=float, default=0.0, help="start_percent of the step cache variants")
    parser.add_argument("--cache-end", type=float, default=1.0, help="end_percent of the step cache variants")
    parser.add_argument("--warm-cache", action="store_true", help="leave Inductor/Overdrive disk caches on")
    parser.add_argument("--budget-gib", type=float, help="emulate a card of this many GiB (ComfyUI's reserve and torch's "
                        "memory fraction, harness/inprocess.py reserve_beyond_budget); the copy rates go beside the figures")
    parser.add_argument("--dynamic-vram", choices=["on", "off"], default="on",
                        help="ComfyUI's dynamic VRAM (its default on NVIDIA GPUs; off: --disable-dynamic-vram). With "
                             "it on the model is loaded from a file, as Load Diffusion Model / Load Checkpoint do")
    parser.add_argument("--from-file", action="store_true", help="load the model from a built-in file (written "
                        "first under --models-dir) through ComfyUI's loader, also with dynamic VRAM off")
    parser.add_argument("--models-dir", default="/tmp/overdrive-bench-models")
    parser.add_argument("--comfy-attention", choices=["sage", "ck"], help="ComfyUI's own attention for the whole "
                        "process (--use-sage-attention, --use-ck-attention): the peers of Overdrive's chooser; every "
                        "variant then runs on it where Overdrive's attention is not installed")
    parser.add_argument("--vae", action="store_true", help="also time VAE decode: eager vs CompileVAE")
    parser.add_argument("--out", default=None)
    parser.add_argument("--verbose", action="store_true", help="ComfyUI's own log too (model loads and unloads)")
    parser.add_argument("--cprofile", action="store_true", help="print where host (Python) time goes in one run of the last variant")
    parser.add_argument("--sync-sources", action="store_true", help="count the synchronizing CUDA calls of one "
                        "run of the last variant by their Python stacks")
    parser.add_argument("--host-timers", action="store_true", help="host time inside ComfyUI's and Overdrive's "
                        "load, dispatch and cleanup functions in one run of each variant (bench/host_timers.py)")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one run of the last variant")
    parser.add_argument("--profile-all", action="store_true", help="with --profile: profile every variant")
    parser.add_argument("--profile-launchers", action="store_true",
                        help="with --profile: also name the host op that launched each top kernel")
    return parser.parse_args()


def import_comfyui(args, cuda: bool, dynamic_vram: bool):
    """ComfyUI as this run needs it (on the CPU or the GPU, dynamic VRAM, an emulated card, its own attention), and
    the host timers if asked for: installed before any model is built, since callbacks keep the bound methods of
    install time. Overdrive's compiler is imported before the timers and its regions after them, in that order."""
    comfy = import_comfy(cpu=not cuda, dynamic_vram=dynamic_vram, budget_gib=args.budget_gib,
                         attention=args.comfy_attention)
    import comfy.sample  # noqa: F401 - the sampler, reached as comfy.sample
    import overdrive.compiler  # noqa: F401
    host_timers = None
    if args.host_timers:
        from host_timers import HostTimers
        host_timers = HostTimers()
    import overdrive.compiler.regions  # noqa: F401
    return comfy, host_timers


def cold_caches():
    """Inductor's FX graph and autotuning caches and Overdrive's disk cache off: every compile time is cold."""
    torch._inductor.config.fx_graph_cache = False
    torch._inductor.config.autotune_local_cache = False
    os.environ["OVERDRIVE_DISK_CACHE"] = "0"


@dataclasses.dataclass
class Sampling:
    """What every variant samples with: ComfyUI, the base model, its conditioning, latent and noise, and the
    sampler's settings (euler, `steps`, the family's scheduler and CFG, seed 42)."""
    comfy: object
    base: object
    positive: object
    negative: object
    latent: torch.Tensor
    noise: torch.Tensor
    scheduler: str
    cfg: float
    dtype: torch.dtype
    steps: int

    def run(self, patcher):
        """One sampling run of `patcher` through ComfyUI's sampler (KSampler's path): the sampled latent."""
        return self.comfy.sample.sample(patcher, self.noise, self.steps, self.cfg, "euler", self.scheduler,
                                        self.positive, self.negative, self.latent, seed=42, disable_pbar=True)


def prepare_sampling(args, comfy, cuda: bool, dynamic_vram: bool) -> Sampling:
    """The base model of --arch (built on the device, or written to a file and loaded by ComfyUI's loader), its
    conditioning, empty latent and noise, and its scheduler and CFG."""
    width, height = args.width or args.res, args.res
    from_file = args.from_file or dynamic_vram or args.layout is not None
    if args.arch in dit.FAMILIES:
        dtype = torch.bfloat16 if cuda else torch.float32
        base = loaded_from_file(comfy, args.arch, args.size, dtype, args.models_dir, args.layout) if from_file \
            else build_dit_model(comfy, args.arch, args.size, dtype)
        positive, negative = dit.conditioning(args.arch, 1), dit.conditioning(args.arch, 2)
        latent = dit.empty_latent(args.arch, width, height, args.frames)
        scheduler, cfg = "simple", args.cfg if args.cfg is not None else dit.FAMILIES[args.arch].sampling["cfg"]
    else:
        dtype = torch.float16 if cuda else torch.float32
        base = loaded_from_file(comfy, args.arch, args.size, dtype, args.models_dir) if from_file \
            else build_model(comfy, args.arch, args.size, dtype)
        positive, negative = conditioning(args.arch, width, height, seed=1)
        latent = torch.zeros(1, 4, height // 8, width // 8)
        scheduler, cfg = "normal", args.cfg if args.cfg is not None else 7.0
    noise = comfy.sample.prepare_noise(latent, 42)
    return Sampling(comfy, base, positive, negative, latent, noise, scheduler, cfg, dtype, args.steps)


@dataclasses.dataclass
class Run:
    """This process's run: its arguments, what every variant samples, the report written as it goes, the first
    variant's final latent and first model call (every variant's errors are against them), Quantize Model's seconds
    per variant and the host timers (--host-timers)."""
    args: argparse.Namespace
    sampling: Sampling
    report: dict
    host_timers: object = None
    reference: torch.Tensor = None
    reference_call: torch.Tensor = None
    calibration: dict = dataclasses.field(default_factory=dict)


def new_report(args, s: Sampling) -> dict:
    """The result file's settings and environment, its rows filled in as the variants run."""
    shapes = [list(t.shape) for t in latent_parts(s.latent)]  # LTX-2's: the video's and the audio's
    return {"benchmark": "compile", "settings": vars(args),
            "environment": {**environment(), **(copy_rates() if args.budget_gib else {})},
            "sampler": f"euler/{s.scheduler}", "cfg": s.cfg, "batch": 1,
            "latent_shape": shapes[0] if len(shapes) == 1 else shapes,  # one shape, as earlier result files have it
            "dtype": str(s.dtype), "results": [], "vae_decode": []}


@dataclasses.dataclass
class Recipe:
    """A variant's parts, and the settings some of them carry (see `make_variant`)."""
    parts: list
    int4: str = None  # "int4mse0.03": Quantize Model with bits 4 (int4_fp8) and that int4_mse_threshold
    fixed: str = None  # "deepcache4": the step cache at that interval
    adaptive: str = None  # "adaptive0.2" / "calibrated0.2": the step cache in that mode at that threshold
    attn: str = None  # "attn0.05": Quantize Model's attention=auto with that bound; "attn8bit0.05": 8bit
    window: str = None  # "window0.1-1.0": the step cache's start/end percent (else --cache-start/--cache-end)
    start_percent: float = 0.0
    end_percent: float = 1.0
    attention: dict = None  # Quantize Model's attention settings


def parse_recipe(variant: str, args) -> Recipe:
    """The parts of `variant` and their settings; an unknown part raises ValueError."""
    parts = variant.split("+")

    def part(prefix):
        return next((p for p in parts if p.startswith(prefix)), None)
    recipe = Recipe(parts, int4=part("int4"), fixed=part("deepcache"),
                    adaptive=part("adaptive") or part("calibrated"), attn=part("attn"),
                    window=part("window"))
    recipe.start_percent, recipe.end_percent = (map(float, recipe.window[len("window"):].split("-")) if recipe.window
                                                else (args.cache_start, args.cache_end))
    recipe.attention = {"attention": "sdpa"}
    if recipe.attn:
        mode = "8bit" if recipe.attn.startswith("attn8bit") else "auto"
        bound = recipe.attn[len("attn8bit" if mode == "8bit" else "attn"):]
        recipe.attention = {"attention": mode, "attention_max_error": float(bound or AttentionConfig().max_error)}
    unknown = (set(parts) - {"eager", "peer", "builtin", "int8", "fp8", recipe.int4, recipe.fixed, "easycache",
                             "lazycache", "stepcache", recipe.adaptive, recipe.attn, "float-memory-bound",
                             recipe.window, "comfy-syncs"}
               - set(COMPILE_OPTIONS) - set(SWITCHES))
    if unknown:
        raise ValueError(f"unknown variant parts {sorted(unknown)}")
    return recipe


def make_variant(run: Run, variant: str):
    """A variant is a '+'-joined recipe, applied in this order: quantize (int8 | fp8 | int4[mse<threshold>], with
    attn<bound> or attn8bit<bound> for 8-bit attention, else attention=sdpa), compile (peer |
    overdrive[-no-cudagraphs|-autotune|-flat|-no-precompile|-comfy-attention]), a step cache (stepcache: the node's
    defaults; deepcache[N]: fixed interval N; adaptive[T] | calibrated[T]: that mode at threshold T;
    easycache / lazycache: ComfyUI's built-in EasyCache / LazyCache with its defaults; window<start>-<end>: the
    cache's start/end percent). 'float-memory-bound': QuantizeModel's weight_only off. 'comfy-syncs': the model
    code's own functions where a family has a host-sync fix (families/__init__.py). 'tanh-gelu': DiT blocks traced
    with torch's tanh-GELU (CompileOptions.fast_activations off: the A/B of compiler/activations.py, see
    `slow_activations`). 'gelu-apart': the fp8 MLPs' first GEMM, GELU and cast unfused (`gelu_apart`).
    'bf16-attention-output': cuDNN's fp8 attention writes its own 16-bit output (`bf16_attention_output`).
    'no-fa3': the attention chooser without FlashAttention-3 (`without_fa3`). 'eager'
    alone is the baseline."""
    recipe = parse_recipe(variant, run.args)
    patcher = quantized(run, variant, recipe, run.sampling.base.clone())
    patcher = compiled(recipe, patcher, run.sampling.base)
    patcher = with_step_cache(run.args, recipe, patcher)
    # The families' host-sync fixes are global once an Overdrive forward was built: a variant without Overdrive's
    # forward, or 'comfy-syncs', runs ComfyUI's own functions.
    parts = recipe.parts
    overdrive_forward = {"int8", "fp8", recipe.fixed, recipe.adaptive} | set(COMPILE_OPTIONS)
    if "comfy-syncs" in parts or not set(parts) & overdrive_forward:
        for family in dit_families():
            for fix in family.host_sync_fixes:
                fix.uninstall()
    return patcher


def quantized(run: Run, variant: str, recipe: Recipe, patcher):
    """`patcher` through Quantize Model in the recipe's format (if any), its time in `run.calibration`."""
    s = run.sampling
    for fmt in ("int8", "fp8", recipe.int4):
        if fmt in recipe.parts:
            start = time.perf_counter()
            settings = {"format": {"int8": "int8", "fp8": "fp8_e4m3"}.get(fmt, "int4_fp8")}
            if fmt == recipe.int4:
                settings["bits"] = 4
                if fmt[len("int4mse"):]:
                    settings["int4_mse_threshold"] = float(fmt[len("int4mse"):])
            patcher = run_node("OverdriveQuantizeModel", model=patcher, **settings, positive=s.positive,
                               negative=s.negative, latent={"samples": s.latent}, **recipe.attention,
                               weight_only="float-memory-bound" not in recipe.parts)
            sync()
            run.calibration[variant] = time.perf_counter() - start
    return patcher


def compiled(recipe: Recipe, patcher, base):
    """`patcher` compiled as the recipe says: the peer (torch.compile of the diffusion model), ComfyUI's built-in
    TorchCompileModel, or Overdrive's Compile Model with one of COMPILE_OPTIONS."""
    from overdrive.compiler.regions import uninstall_regions
    if "peer" in recipe.parts:
        uninstall_regions(base.model.diffusion_model)  # an earlier Overdrive variant's regions: not the peer's
        patcher.add_object_patch("diffusion_model", torch.compile(base.model.diffusion_model, backend="inductor"))
    if "builtin" in recipe.parts:  # ComfyUI's TorchCompileModel node, backend inductor: its own code path (the node's
        # module imports ComfyUI's V3 API, whose video types need PyAV: its two lines, as they are)
        from comfy_api.torch_helpers import set_torch_compile_wrapper
        uninstall_regions(base.model.diffusion_model)
        patcher = patcher.clone(disable_dynamic=True)
        set_torch_compile_wrapper(patcher, backend="inductor", options={"guard_filter_fn": lambda entries: [
            "transformer_options" not in entry.name for entry in entries]})
    for name, overrides in COMPILE_OPTIONS.items():
        if name in recipe.parts:
            patcher = run_node("OverdriveCompileModel", model=patcher, **overrides)
    return patcher


def with_step_cache(args, recipe: Recipe, patcher):
    """`patcher` with the recipe's step cache: Overdrive's DeepCache (its defaults, a fixed interval, adaptive or
    calibrated) or ComfyUI's EasyCache or LazyCache."""
    if "stepcache" in recipe.parts:
        patcher = run_node("OverdriveDeepCache", model=patcher)
    if recipe.fixed:
        patcher = run_node("OverdriveDeepCache", model=patcher, mode="fixed",
                           cache_interval=int(recipe.fixed[len("deepcache"):] or args.cache_interval),
                           start_percent=recipe.start_percent, end_percent=recipe.end_percent)
    if recipe.adaptive:
        mode = "calibrated" if recipe.adaptive.startswith("calibrated") else "adaptive"
        patcher = run_node("OverdriveDeepCache", model=patcher, mode=mode,
                           threshold=float(recipe.adaptive[len(mode):] or args.cache_threshold),
                           start_percent=recipe.start_percent, end_percent=recipe.end_percent)
    for peer, node_id in (("easycache", "EasyCache"), ("lazycache", "LazyCache")):
        if peer in recipe.parts:
            from overdrive.harness.fidelity import apply_node
            patcher = apply_node(node_id, patcher, {})
    return patcher


def per_step_errors(s: Sampling, patcher):
    """A step cache's error per model call: each call's output against the full model's (eager) on the same
    input, over one run."""
    calls = []

    def record(apply_model, call):
        out = apply_model(call["input"], call["timestep"], **call["c"])
        calls.append((call["input"].clone(), call["timestep"].clone(), dict(call["c"]), out.float().clone()))
        return out
    options = patcher.model_options
    patcher.model_options = {**options, "model_function_wrapper": record}
    try:
        s.run(patcher)
    finally:
        patcher.model_options = options
    full = s.base.clone()
    s.comfy.model_management.load_models_gpu([full])
    errors = []
    with torch.no_grad():
        for x, t, c, out in calls:
            c = dict(c)
            c["transformer_options"] = {k: v for k, v in c.get("transformer_options", {}).items()
                                        if k not in ("wrappers", "callbacks")}
            expected = full.model.apply_model(x, t, **c).float()
            errors.append(round(float((out - expected).norm() / expected.norm()), 5))
    return errors


def step_cache_stats(patcher) -> dict:
    """The last run's full / reused steps and the adaptive rule's measured changes. (A function, so that no name in
    the variants' loop holds the cache: it holds its model, and a dropped variant's 8-bit layers stayed alive.)"""
    cache = getattr(patcher.object_patches.get("diffusion_model.forward"), "step_cache", None)
    if cache is None:
        return {}
    return {"steps_full_reused": [cache.last_stats.full_steps, cache.last_stats.shallow_steps]
            if cache.last_stats else None,
            "adaptive_changes": [None if c is None else round(c, 4) for c in cache.changes]}


def block_graphs(patcher):
    """What a DiT's block CUDA graphs did (compiler/block_graphs.py), or None."""
    graphs = getattr(patcher.object_patches.get("diffusion_model.forward"), "graphs", None)
    return graphs.describe() if graphs is not None else None


def sample(s: Sampling, patcher, first_call=None):
    """(final latent, seconds); with a list `first_call`, the output of the run's first model call is put in it
    (the same input in every variant: noise at the first sigma)."""
    options = patcher.model_options
    if first_call is not None:  # on the timed model itself: a clone would be another model to ComfyUI's loader
        from overdrive.comfy_host.quantize_patches import followers

        def record(apply_model, call):
            out = apply_model(call["input"], call["timestep"], **call["c"])
            if not first_call:
                first_call.append(out.float().clone())
                first_call.append(weights_gib(patcher.model.diffusion_model))
                first_call.append(weights_gib(patcher.model.diffusion_model, gpu_only=False))
                first_call.append((patcher.model_size() - patcher.loaded_size()) / 2**30)  # ComfyUI's account
                first_call.append(sum(f.streamed_bytes for f in followers(patcher)) / 2**30)  # Overdrive's
            return out
        patcher.model_options = {**options, "model_function_wrapper": record}
    sync()
    start = time.perf_counter()
    try:
        out = s.run(patcher)
    finally:
        patcher.model_options = options
    sync()
    return dit.flat_latent(out), time.perf_counter() - start  # LTX-2's video and audio as one tensor


def run_variant(run: Run, variant: str) -> None:
    """One variant: made, sampled once (compiling), timed, analysed and dropped; its row in the report, written at
    once and again after the drop (a run stopped at its time limit keeps what it measured)."""
    restores = [switch() for part, switch in SWITCHES.items() if part in variant.split("+")]
    row = measure_and_drop(run, variant)
    if row is None:  # failed: the report's "failed" says why (its switches stay as they are)
        return
    # A dropped variant must not keep its 8-bit layers (a name in this loop that held a step cache kept its model
    # alive, and peak VRAM grew by a quantized model per step-cache variant): what is still alive, by device.
    row["live_8bit_gib_after_drop"] = live_quantized_gib()
    write_report(run.report, run.args.out)
    for restore in restores:
        restore()


def measure_and_drop(run: Run, variant: str):
    """The variant's row (None if its first run failed), the variant dropped and ComfyUI's models unloaded."""
    from overdrive.compiler import dynamo_graph_count
    args, s, cuda = run.args, run.sampling, torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    measured_before = dict(CHOOSER.reports)
    patcher = make_variant(run, variant)
    nodes_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # Quantize Model's calibration
    graphs_before = dynamo_graph_count()
    first_call = []
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        _, first = sample(s, patcher, first_call)
    except Exception as error:  # noqa: BLE001 - a peer that cannot run this family (ComfyUI's EasyCache indexes
        # LTX-2's [video, audio] input as one tensor): its row says why, and the other variants still run
        run.report.setdefault("failed", []).append({"variant": variant, "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(run.report["failed"][-1]), flush=True)
        traceback.print_exc()  # where it failed, in the log beside the row
        write_report(run.report, args.out)
        del patcher
        s.comfy.model_management.unload_all_models()
        return None
    first_peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # the first load and compile
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        out, dt = sample(s, patcher)
        times.append(dt)
    row = timed_row(run, variant, patcher, first, statistics.median(times), out, dynamo_graph_count() - graphs_before,
                    nodes_peak, first_peak)
    add_errors_and_weights(run, row, out, first_call)
    analyse(run, variant, patcher, row)
    row["attention_choices"] = attention_choices(measured_before)
    run.report["results"].append(row)
    print(json.dumps(row), flush=True)
    write_report(run.report, args.out)  # after each row: a run stopped at its time limit keeps what it measured

    del patcher
    s.comfy.model_management.unload_all_models()
    s.comfy.model_management.soft_empty_cache()
    return row


def timed_row(run: Run, variant: str, patcher, first: float, per_image: float, out, graphs: int, nodes_peak,
              first_peak) -> dict:
    """The variant's times, graphs and memory, read as its timed runs end."""
    cuda = torch.cuda.is_available()
    return {"variant": variant, "first_run_s": round(first, 3), "s_per_image": round(per_image, 4),
            "s_per_step": round(per_image / run.args.steps, 5), "compile_s_est": round(first - per_image, 2),
            "dynamo_graphs": graphs,
            "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
            "nodes_peak_vram_gib": None if nodes_peak is None else round(nodes_peak, 3),
            "first_run_peak_vram_gib": None if first_peak is None else round(first_peak, 3),
            "device_used_gib": round((lambda free, total: (total - free) / 2**30)(*torch.cuda.mem_get_info()), 3)
            if cuda else None,  # what the process holds, the allocator's cache and non-PyTorch memory included
            "finite": bool(torch.isfinite(out).all()),
            "quantize_node_s": round(run.calibration[variant], 2) if variant in run.calibration else None,
            "compile_phases_s": compile_phases(), "block_graphs": block_graphs(patcher)}


def add_errors_and_weights(run: Run, row: dict, out, first_call: list) -> None:
    """The row's errors against the first variant (its final latent and first model call), where its weights were
    at the first call, and what copying the rest in at every call would cost."""
    if run.reference is None:
        run.reference, run.reference_call = out, first_call[0]
    row["rel_err_vs_first_variant"] = float((out - run.reference).norm() / run.reference.norm())
    row["first_call_rel_err"] = float((first_call[0] - run.reference_call).norm() / run.reference_call.norm())
    row["weights_gib_on_gpu"] = first_call[1]
    # What does not stay on the GPU is copied in at every model call: its cost over a desktop's PCIe 4.0 x16 link.
    row["weights_gib_in_tree"] = first_call[2]
    row["weights_gib_not_loaded"] = round(first_call[3], 3)  # ComfyUI's model_size - loaded_size
    row["quantized_gib_streamed"] = round(first_call[4], 3)  # Quantize Model's layers in pinned host memory
    add_stream_estimate(row, run.args.steps * (2 if run.sampling.cfg > 1 else 1))


def analyse(run: Run, variant: str, patcher, row: dict) -> None:
    """Where the variant's time goes, as asked (--profile, --host-timers, --cprofile, --sync-sources), and a step
    cache's error per model call. Profiled before the per-call errors load the float model beside this one (its
    loads and unloads then filled the profile with copies)."""
    args, s, cuda = run.args, run.sampling, torch.cuda.is_available()
    last = variant == args.variants.split(",")[-1]  # the one the host and sync analyses look at
    if args.profile and cuda and (args.profile_all or last):
        print(f"[{variant}]")
        profile_run(lambda: sample(s, patcher), args.steps, launchers=args.profile_launchers)
    if args.host_timers:
        print(f"[{variant}]")
        row["host_timers"] = run.host_timers.run(lambda: sample(s, patcher), args.steps)
    if args.cprofile and last:
        cprofile_run(lambda: sample(s, patcher))
    if args.sync_sources and cuda and last:
        sync_sources(lambda: sample(s, patcher))
    step_cache = any(p.startswith(("deepcache", "easycache", "lazycache", "adaptive", "calibrated", "stepcache"))
                     for p in variant.split("+"))
    if step_cache and args.arch in dit.FAMILIES:
        row["per_call_rel_err"] = per_step_errors(s, patcher)
        row.update(step_cache_stats(patcher))


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    logging.getLogger("overdrive").setLevel(logging.INFO)  # what was compiled, quantized and why, beside the figures
    cuda = torch.cuda.is_available()
    dynamic_vram = cuda and args.dynamic_vram == "on"
    comfy, host_timers = import_comfyui(args, cuda, dynamic_vram)
    if not args.warm_cache:
        cold_caches()
    sampling = prepare_sampling(args, comfy, cuda, dynamic_vram)
    run = Run(args, sampling, new_report(args, sampling), host_timers)
    for variant in args.variants.split(","):
        run_variant(run, variant)
    results = run.report["results"]
    run.report["vae_decode"] = bench_vae(comfy, run.reference, args.repeats, args.arch) if args.vae else []
    add_speedups(results)
    finish(run.report, results, COLUMNS, args.out)


if __name__ == "__main__":
    main()

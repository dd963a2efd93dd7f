"""A diffusers model's calls split over the processes of a torch.distributed group (`SplitForward`, which
parallelize_ installs), as diffusers' own context parallelism and xDiT run: every process (launched by torchrun, one
per GPU) runs the same pipeline with the same seed and holds its own copy of the model. A call's batch is split (the
SD3, SDXL and LTX pipelines batch CFG's two passes: CFG parallelism), or its image tokens (sequence parallelism, by the
family's DiffusersSplit rule, parallel/sequence_split.py's Ulysses attention): the first block takes this process's
shard, with its rotary frequencies and per-token modulation, every self- or joint attention runs over all shards, and
the last block's output is gathered. Every process ends with the whole output."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..attention.routing import SDPA_ARGUMENTS
from ..parallel.agreement import whole_group_call
from ..parallel.batch_split import split_call
from ..parallel.config import ParallelConfig, chosen, why_not_groups
from ..families import FAMILIES, family_of
from ..parallel.split_rules import DiffusersSplit, PerToken
from ..parallel.sequence_split import (all_gather, attention_split, gather, over, rank_and_world, sequence_groups,
                                       shard, sharded_attention, why_not_shard)

log = logging.getLogger("overdrive")


def split_of(module) -> DiffusersSplit | None:
    """How sequence parallelism splits this diffusers transformer (its family's rule), or None."""
    if not type(module).__module__.startswith("diffusers."):
        return None  # ComfyUI's Qwen-Image has diffusers' class name: comfy_host/sequence_split.py splits it
    family = family_of(module)
    return family.split_rule(DiffusersSplit) if family is not None else None


def split_names() -> list:
    return [name for name, family in FAMILIES.items() if family.split_rule(DiffusersSplit) is not None]


@functools.lru_cache(maxsize=None)
def parameter_names(function) -> tuple:
    """A module method's parameters after self (read once per class: the hooks run at every block call)."""
    return tuple(inspect.signature(function).parameters)[1:]


def call_arguments(function, args: tuple, kwargs: dict) -> dict:
    """A call's arguments by name (the module's own `function`'s parameters, after self)."""
    return {**dict(zip(parameter_names(function), args)), **kwargs}


def _replaced(function, args: tuple, kwargs: dict, name: str, value) -> tuple:
    """(args, kwargs) with argument `name` set to `value`, passed the way the call passed it."""
    position = parameter_names(function).index(name)
    if name not in kwargs and position < len(args):
        return args[:position] + (value,) + args[position + 1:], kwargs
    return args, {**kwargs, name: value}


# -- the attention ---------------------------------------------------------------------------------------------------
class ShardedSDPA(TorchFunctionMode):
    """Within a split call: every SDPA call whose keys are as many as its queries, this process's image tokens
    (`local`) with the text or without (Flux's and Qwen's joint attention, SD3's, SD3.5's second one, Wan's
    self-attention), runs over every process's tokens (parallel/sequence_split.sharded_attention); any other (Wan's
    cross-attention to the text) as it is. One instance per geometry: compiled blocks guard on the mode they traced."""
    _instances: dict = {}

    def __new__(cls, local: int, text: int, text_first: bool):
        made = cls._instances.get((local, text, text_first))
        if made is None:
            made = cls._instances[(local, text, text_first)] = super().__new__(cls)
            made.local, made.text, made.text_first = local, text, text_first
        return made

    def __init__(self, *args):
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            given = dict(zip(("query", "key", "value", *SDPA_ARGUMENTS), args), **kwargs)
            q, k, v = given["query"], given["key"], given["value"]
            length = q.shape[-2]
            if k.shape[-2] == length and length - self.local in (0, self.text):
                return self._over_every_shard(q, k, v, given, text=length - self.local)
        return func(*args, **kwargs)

    def _over_every_shard(self, q, k, v, given: dict, text: int):
        if given.get("dropout_p") or given.get("is_causal") or given.get("enable_gqa") or k.shape[1] != q.shape[1]:
            raise NotImplementedError("parallelize_: sequence parallelism splits plain attention only (no dropout, "
                                      "causal mask or grouped heads); use ParallelConfig(mode='cfg')")
        mask, world = given.get("attn_mask"), rank_and_world()[1]
        if mask is not None:
            mask = self._whole_key_mask(mask, text, q.shape[-2] - text, world)
        first = self.text_first or not text

        def text_first_order(t):  # SD3 puts its text after the image tokens; the split attention takes it first
            return t if first else torch.cat((t[:, :, self.local:], t[:, :, :self.local]), dim=2)
        out = sharded_attention(*(text_first_order(t) for t in (q, k, v)),
                                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                               scale=given.get("scale")),
                                text=text)
        return out if first else torch.cat((out[:, :, text:], out[:, :, :text]), dim=2)

    def _whole_key_mask(self, mask: torch.Tensor, text: int, local: int, world: int) -> torch.Tensor:
        """A key-padding mask over the text and this shard (Qwen-Image's: (batch, 1, 1, keys), every image token
        kept) as one over the text and every shard, in Ulysses' text-first order."""
        if mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
            raise NotImplementedError("parallelize_: sequence parallelism splits attention masked by key only (the "
                                      "text's padding); use ParallelConfig(mode='cfg')")
        text_part = mask[..., :text] if self.text_first else mask[..., local:]
        kept = torch.ones((), dtype=mask.dtype, device=mask.device) if mask.dtype == torch.bool \
            else torch.zeros((), dtype=mask.dtype, device=mask.device)
        return torch.cat((text_part, kept.expand(*mask.shape[:3], local * world)), dim=-1)


# -- the blocks ------------------------------------------------------------------------------------------------------
class ShardedBlocks:
    """Hooks, for one call, on the blocks of a transformer of a known family: the first block's image stream is
    sharded, every block's per-token arguments too, the last block's image stream gathered."""

    def __init__(self, module, family, split: DiffusersSplit, tokens: int, text: int):
        self.split, self.tokens, self.text, self.handles = split, tokens, text, []
        blocks = family.blocks(module)
        first_stack, _, first = blocks[0]
        last_stack, _, last = blocks[-1]
        self.image = first_stack.streams[0][0]  # "hidden_states" in every family split
        self.last_stack = last_stack
        for _, _, block in blocks:
            self.handles.append(block.register_forward_pre_hook(
                functools.partial(self._before, first=block is first), with_kwargs=True))
        self.handles.append(last.register_forward_hook(self._after))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _before(self, block, args, kwargs, first: bool):
        rank, world = rank_and_world()
        function = type(block).forward
        given = call_arguments(function, args, kwargs)
        if first:
            args, kwargs = _replaced(function, args, kwargs, self.image, shard(given[self.image], 1, rank, world))
        for entry in self.split.per_token:
            value = given.get(entry.name)
            if value is not None:
                sharded = self._sharded(value, entry, self.text if entry.text else 0, rank, world)
                args, kwargs = _replaced(function, args, kwargs, entry.name, sharded)
        return args, kwargs

    def _sharded(self, value, entry: PerToken, lead: int, rank: int, world: int):
        if isinstance(value, (tuple, list)):
            return type(value)(self._sharded(v, entry, lead, rank, world) if entry.part in (None, i) else v
                               for i, v in enumerate(value))
        if isinstance(value, torch.Tensor) and value.ndim > entry.dim and value.shape[entry.dim] == lead + self.tokens:
            return shard(value, entry.dim, rank, world, lead)
        return value  # not per token in this call (Wan's modulation without a timestep per token)

    def _after(self, block, args, out):
        values = self.last_stack.named(out)
        values[self.image] = gather(values[self.image], 1)
        return self.last_stack.output(values)


# -- the forward -----------------------------------------------------------------------------------------------------
class SplitForward:
    """A model's forward run over every process of the group: each call by its batch or its tokens (`config.mode`),
    or whole where it cannot be split (logged once per reason). `inner`: the forward it wraps (compiled,
    step-cached), None for the module's own."""

    overdrive_stack = None  # set by stack.build
    wraps_forward = True

    def __init__(self, module, inner, config: ParallelConfig, family):
        self.module, self.inner, self.config, self.family = module, inner, config, family
        self.latent = parameter_names(type(module).forward)[0]  # a UNet's is "sample"
        self._told = set()

    def __call__(self, *args, **kwargs):
        run = self.inner or functools.partial(type(self.module).forward, self.module)
        given = call_arguments(type(self.module).forward, args, kwargs)
        world = dist.get_world_size() if dist.is_initialized() else 1
        split, why = self.choose(given, world)
        if split is None:
            self._tell(why)
            return run(*args, **kwargs)
        attention = ""
        if split != "cfg":
            heads = self.module.config.num_attention_heads
            tokens_over = world // given[self.latent].shape[0] if split == "both" else world
            attention = f" ({attention_split(heads, tokens_over)} attention, {heads} heads)"
        self._tell(f"{split} parallelism over {world} processes{attention}")
        with whole_group_call():
            if split == "cfg":
                return self._by_batch(run, given, world)
            if split == "both":
                return self._by_batch_and_tokens(run, given, world)
            return self._by_tokens(run, given, world)

    def __getattr__(self, name):  # a step cache's statistics read through
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def _tell(self, what: str) -> None:
        if what not in self._told:
            self._told.add(what)
            log.info("Overdrive parallelize_: %s: %s", type(self.module).__name__, what)

    def choose(self, given: dict, world: int) -> tuple:
        """("cfg" | "both" | "sequence", None), or (None, why the call runs whole in every process)."""
        if world < 2:
            return None, "a group of one process runs every call whole"
        return chosen(self.config.mode, lambda split: self.why_not(split, given, world))

    def why_not(self, split: str, given: dict, world: int) -> str | None:
        batch = given[self.latent].shape[0]
        if split == "cfg":
            return f"its batch of {batch} does not divide over {world} processes" if batch % world else None
        if split == "sequence":
            return self.why_not_sequence(given, world)
        return why_not_groups(world, batch, "batch entries") or self.why_not_sequence(given, world // batch)

    def why_not_sequence(self, given: dict, world: int) -> str | None:
        split = split_of(self.module)
        if split is None or self.family is None:
            return (f"{type(self.module).__name__} is not among the transformers sequence parallelism splits "
                    f"({', '.join(split_names())})")
        tokens = split.tokens(self.module, given[self.latent])
        if split.text_first is None:  # a cross-attention as long as a shard would read as the shard's own
            lengths = {given[n].shape[1] for n in ("encoder_hidden_states", "encoder_hidden_states_image")
                       if isinstance(given.get(n), torch.Tensor)}
            if tokens // world in lengths or sum(lengths) == tokens // world:
                return f"a shard of its tokens is as long as its text ({tokens // world} tokens)"
        return why_not_shard(tokens, world)

    def _batch_part(self, given: dict, parts: int, part: int) -> dict:
        """The call's arguments for part `part` of its batch cut in `parts`."""
        x, rest = given[self.latent], {k: v for k, v in given.items() if k not in (self.latent, "timestep")}
        px, pt, pk = split_call(x, given.get("timestep"), rest, parts, parts)[part]
        return {self.latent: px, **({"timestep": pt} if "timestep" in given else {}), **pk}

    def _by_batch(self, run, given: dict, world: int):
        out = run(**self._batch_part(given, world, dist.get_rank()))
        return _each_sample(out, lambda sample: all_gather(sample, 0))

    def _by_batch_and_tokens(self, run, given: dict, world: int):
        """Batch entry r // size on the group of `size` processes r is in, which splits its tokens."""
        batch = given[self.latent].shape[0]
        size = world // batch
        with over(sequence_groups(size)):
            out = self._by_tokens(run, self._batch_part(given, batch, dist.get_rank() // size), size)

        def each_entry_once(sample):  # every process of a group holds its entry's whole output
            return all_gather(sample, 0).unflatten(0, (world, -1))[::size].flatten(0, 1)
        return _each_sample(out, each_entry_once)

    def _by_tokens(self, run, given: dict, world: int):
        split = split_of(self.module)
        tokens = split.tokens(self.module, given[self.latent])
        text = given["encoder_hidden_states"].shape[1] if split.text_first is not None else 0
        blocks = ShardedBlocks(self.module, self.family, split, tokens, text)
        try:
            with ShardedSDPA(tokens // world, text, bool(split.text_first)):
                return run(**given)
        finally:
            blocks.remove()


def _each_sample(out, change):
    """The model's output (a tuple, or an output object) with its sample changed."""
    if isinstance(out, tuple):
        return (change(out[0]), *out[1:])
    if isinstance(out, torch.Tensor):
        return change(out)
    return dataclasses.replace(out, sample=change(out.sample))

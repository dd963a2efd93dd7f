"""Sequence parallelism in ComfyUI's model calls (parallel/sequence_split.py's arithmetic): block replacements shard
the image tokens, with their rotary frequencies and per-token modulation, as the first block takes them and gather
them after the last, and an attention override runs the self-attention of the shards as one (Ulysses). Every
process of the group runs the same call with the same options; the objects here pickle, so workers get them with
the call. Families: those whose blocks take their image tokens alone as "img" and attend to the text in a separate
cross-attention (Wan); a joint text-and-image attention (Flux, SD3, Qwen-Image) is not split yet."""
from __future__ import annotations

from ..parallel.sequence_split import gather, rank_and_world, shard, ulysses_attention, why_not_shard
from .comfy_call_options import ATTENTION_OVERRIDE, active_patches

FAMILIES = ("WanModel",)  # ComfyUI's diffusion model classes whose blocks this splits


def why_not_sequence(diffusion_model, x, world: int, transformer_options: dict, cross_lengths: tuple) -> str | None:
    """Why a call on latent `x` cannot run sequence-parallel over `world` processes (None: it can). `cross_lengths`:
    the key lengths of its cross-attention (text, image features)."""
    name = type(diffusion_model).__name__
    if name not in FAMILIES:
        return f"{name} is not among the families sequence parallelism splits ({', '.join(FAMILIES)})"
    patches, replaces = active_patches(transformer_options)
    if "dit" in replaces or "double_block" in patches:
        return "other nodes replace or patch its blocks"
    tokens = image_tokens(diffusion_model, x)
    if tokens // world in cross_lengths:  # the override tells self-attention apart by its key length
        return f"a shard of its tokens is as long as its text ({tokens // world} tokens)"
    return why_not_shard(tokens, diffusion_model.blocks[0].self_attn.num_heads, world)


def image_tokens(diffusion_model, x) -> int:
    """The image tokens of a Wan call on latent `x` (batch, channels, frames, height, width)."""
    pt, ph, pw = diffusion_model.patch_size
    frames, height, width = x.shape[2:]
    return -(-frames // pt) * -(-height // ph) * -(-width // pw)


class ShardedBlock:
    """A block replacement: the first block shards the tokens, every block gets its shard of the per-token inputs,
    the last block's output is gathered."""

    def __call__(self, args: dict, extra: dict) -> dict:
        rank, world = rank_and_world()
        options = args["transformer_options"]
        index, img = options["block_index"], args["img"]
        if index == 0:
            img = shard(img, 1, rank, world)
        tokens = img.shape[1] * world
        out = extra["original_block"]({**args, "img": img, "pe": _shard_tokens(args["pe"], tokens, rank, world),
                                       "vec": _shard_tokens(args["vec"], tokens, rank, world)})
        if index == options["total_blocks"] - 1:
            out = {**out, "img": gather(out["img"], 1, world)}
        return out


def _shard_tokens(value, tokens: int, rank: int, world: int):
    """A per-token input's shard (dimension 1 holds the tokens); one shared by every token as it is."""
    if value is not None and value.ndim > 1 and value.shape[1] == tokens:
        return shard(value, 1, rank, world)
    return value


class ShardedAttention:
    """ComfyUI's attention override: the self-attention of the shards (keys as many as the queries: this rank's
    tokens, a length no cross-attention has, see `why_not_sequence`) over every token; the cross-attention to the
    text (whole on every rank) as it is. `previous`: the override it replaces in this process (none in a worker)."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, func, q, k, v, *args, heads, **kwargs):
        def attend(q, k, v, heads):
            if self.previous is not None:
                return self.previous(func, q, k, v, *args, heads=heads, **kwargs)
            return func(q, k, v, *args, heads=heads, **kwargs)

        if q.shape[1] != k.shape[1]:
            return attend(q, k, v, heads)
        if kwargs.get("skip_reshape") or kwargs.get("skip_output_reshape") or args:
            raise NotImplementedError("sequence parallelism reads attention in (batch, tokens, heads x dim) only")
        return ulysses_attention(q, k, v, heads, attend)


def sequence_options(transformer_options: dict, blocks: int) -> dict:
    """A copy of a call's options that runs it sequence-parallel (the original is left as it was); an attention
    override already there (Overdrive's) runs each rank's share of the heads."""
    previous = transformer_options.get(ATTENTION_OVERRIDE)
    replace = dict(transformer_options.get("patches_replace", {}))
    replace["dit"] = {("double_block", i): ShardedBlock() for i in range(blocks)}
    return {**transformer_options, "patches_replace": replace, ATTENTION_OVERRIDE: ShardedAttention(previous)}

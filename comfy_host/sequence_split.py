"""Sequence parallelism in ComfyUI's model calls (parallel/sequence_split.py's arithmetic): block replacements shard
the image tokens, with their rotary frequencies (and Wan's per-token modulation), as the first block takes them and
gather them after the last, and an attention override runs the self-attention of the shards as one (Ulysses). Every
process of the group runs the same call with the same options; the objects here pickle, so workers get them with
the call. Families: Wan (the text in a cross-attention of its own), and Flux, SD3 and Qwen-Image (the text joins the
image tokens in one attention: whole on every process, each attending with its own heads of it)."""
from __future__ import annotations


from ..parallel.sequence_split import (attention_split, gather, over, rank_and_world, sequence_groups, shard,
                                       sharded_attention, why_not_shard)
from ..families import family_of, family_titles
from ..parallel.split_rules import SplitFamily
from .comfy_call_options import ATTENTION_OVERRIDE, SEQUENCE_SHARD, active_patches


def split_family(diffusion_model) -> SplitFamily | None:
    """How sequence parallelism splits this ComfyUI diffusion model (its family's rule), or None."""
    family = family_of(diffusion_model)
    return family.split_rule(SplitFamily) if family is not None else None


def split_family_names() -> str:
    return family_titles(lambda family: family.split_rule(SplitFamily) is not None)


def why_not_sequence(diffusion_model, x, world: int, transformer_options: dict, cross_lengths: tuple) -> str | None:
    """Why a call on latent `x` cannot run sequence-parallel over `world` processes (None: it can). `cross_lengths`:
    the key lengths of its cross-attention (text, image features)."""
    family = split_family(diffusion_model)
    if family is None:
        return (f"{type(diffusion_model).__name__} is not among the families sequence parallelism splits "
                f"({split_family_names()})")
    patches, replaces = active_patches(transformer_options)
    if "dit" in replaces or "double_block" in patches:
        return "other nodes replace or patch its blocks"
    tokens = image_tokens(x, family.patch(diffusion_model))
    if not family.joint and tokens // world in cross_lengths:  # a cross-attention would read as a shard's own
        return f"a shard of its tokens is as long as its text ({tokens // world} tokens)"
    return why_not_shard(tokens, world)


def how_attention_splits(diffusion_model, world: int) -> str:
    """How the split attention of this model runs over `world` processes (for the log)."""
    heads = split_family(diffusion_model).heads(diffusion_model)
    return f"{attention_split(heads, world)} attention, {heads} heads"


def image_tokens(x, patch: tuple) -> int:
    """The image tokens of a call on latent `x` ((batch, channels, [frames,] height, width)), patches of `patch`."""
    frames = x.shape[2] if x.ndim == 5 else 1
    return -(-frames // patch[0]) * -(-x.shape[-2] // patch[1]) * -(-x.shape[-1] // patch[2])


class ShardedBlock:
    """A block replacement: the first block shards the image tokens, every block gets its shard of the per-token
    inputs, the last block's output is gathered. `single`: a Flux single block, whose "img" holds the text first.
    The block itself runs as it would (the step cache may stand in for it: each process's residual is its shard's)."""
    overdrive_own = True  # comfy_host/comfy_steps.py

    def __init__(self, family: SplitFamily, first: bool, last: bool, single: bool, group_size: int | None = None):
        self.first, self.last, self.single, self.group_size = first, last, single, group_size
        self.joint, self.pe_dim, self.vec_per_token = family.joint, family.pe_dim, family.vec_per_token  # it pickles

    def __call__(self, args: dict, extra: dict) -> dict:
        # With CFG split too ("both"), each pass's processes split its tokens among themselves: the block, its
        # attention and its shards run over their group.
        with over(sequence_groups(self.group_size) if self.group_size else None):
            return self._split(args, extra)

    def _split(self, args: dict, extra: dict) -> dict:
        rank, world = rank_and_world()
        options = args["transformer_options"]
        lead = options["img_slice"][0] if self.single else 0  # text tokens inside "img"
        img = shard(args["img"], 1, rank, world, lead) if self.first else args["img"]
        tokens = (img.shape[1] - lead) * world
        text = lead if self.single else args["txt"].shape[1] if self.joint else 0
        inputs = {**args, "img": img, "transformer_options": {**options, SEQUENCE_SHARD: (text, tokens // world)}}
        pe, dim = args.get("pe"), self.pe_dim
        if pe is not None and dim is not None and pe.shape[dim] == text + tokens:
            inputs["pe"] = shard(pe, dim, rank, world, text)
        vec = args.get("vec")
        if self.vec_per_token and getattr(vec, "ndim", 0) > 1 and vec.shape[1] == tokens:
            inputs["vec"] = shard(vec, 1, rank, world)
        out = extra["original_block"](inputs)
        return {**out, "img": gather(out["img"], 1, lead)} if self.last else out


class ShardedAttention:
    """ComfyUI's attention override: a block's self-attention over its shard (keys as many as the queries, text and
    this rank's image tokens, as ShardedBlock marked them) runs over every rank's tokens; any other attention (Wan's
    cross-attention to the text, whole on every rank) as it is. `previous`: the override it replaces in this process
    (Overdrive's attention, or none). One instance per `previous`, as compiled blocks guard on it and trace it into
    their graph, collectives and all."""
    overdrive_attention = True  # compiled blocks may take it (comfy_host/comfy_call_options.py)
    # A block's CUDA graph then holds NCCL collectives, which must be dropped before the process leaves its group
    # (compiler/block_graphs.py, parallel/workers.py).
    records_collectives = True
    _instances = {}

    def __new__(cls, previous=None):
        made = cls._instances.get(previous)
        if made is None:
            made = cls._instances[previous] = super().__new__(cls)
            made.previous = previous
        return made

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # a worker unpickles its own one instance
        return type(self), (self.previous,)

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def attend(q, k, v, heads, skip_reshape, skip_output_reshape):
            call = self.previous or (lambda f, *a, **kw: f(*a, **kw))
            return call(func, q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        split = (kwargs.get("transformer_options") or {}).get(SEQUENCE_SHARD)
        length = q.shape[2 if skip_reshape else 1]
        if split is None or k.shape[2 if skip_reshape else 1] != length or length - split[1] not in (0, split[0]):
            return attend(q, k, v, heads, skip_reshape, skip_output_reshape)
        if mask is not None:
            raise NotImplementedError("sequence parallelism does not split masked attention (Parallel Model "
                                      "refuses calls with an attention mask)")
        b = q.shape[0]
        if not skip_reshape:
            q, k, v = (t.view(b, length, heads, -1).transpose(1, 2) for t in (q, k, v))
        out = sharded_attention(q, k, v, lambda q, k, v: attend(q, k, v, q.shape[1], True, True),
                                text=length - split[1])
        return out if skip_output_reshape else out.transpose(1, 2).reshape(b, length, -1)


def sequence_options(transformer_options: dict, diffusion_model, group_size: int | None = None) -> dict:
    """A copy of a call's options that runs it sequence-parallel over every process (`group_size`: over groups of
    that many consecutive processes, each with its own part of the batch); the original is left as it was. An
    attention override already there (Overdrive's) runs each rank's share of the heads."""
    family = split_family(diffusion_model)
    keys = family.blocks(diffusion_model)
    replace = dict(transformer_options.get("patches_replace", {}))
    replace["dit"] = {key: ShardedBlock(family, i == 0, i == len(keys) - 1, key[0] == "single_block", group_size)
                      for i, key in enumerate(keys)}
    previous = transformer_options.get(ATTENTION_OVERRIDE)
    return {**transformer_options, "patches_replace": replace, ATTENTION_OVERRIDE: ShardedAttention(previous)}


def as_each_process_runs(patcher):
    """A clone of `patcher` whose every call runs as each process of a sequence split runs its part (in a group of
    one process: the whole path, each collective a copy), for measuring the split on one GPU."""
    clone = patcher.clone()
    clone.model_options["transformer_options"] = sequence_options(
        clone.model_options.get("transformer_options", {}), clone.model.diffusion_model)
    return clone

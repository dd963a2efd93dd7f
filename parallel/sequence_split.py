"""A model call's tokens split over the processes of a torch.distributed group (sequence parallelism, Ulysses):
every process holds one contiguous shard of the image tokens through the blocks, and each attention call trades
shards of tokens for shards of heads with one all-to-all, attends over all tokens for its heads, and trades back.
Text tokens that join the image's in one attention (Flux, SD3, Qwen-Image) are whole on every process: each attends
with its own heads of them, and the heads are gathered after. Where the heads do not divide over the processes, each
process gathers every process's keys and values instead and attends with its own queries (torch's context_parallel
rotates keys and values the same way by default): more traffic than Ulysses (all keys and values to every process),
the same result. Only the attention sees every token; everything else in a block works token by token, so the shards
are exact. The group is every process, or within `over(group)` one of `sequence_groups`' (CFG and sequence
parallelism at once: each CFG pass's processes split its tokens). The arithmetic only: where a front end shards,
attends and gathers is its own (comfy_host/sequence_split.py, diffusers_api/sequence_split.py)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

# torch.distributed's functional collectives: eager, and traced into a compiled block's graph (Inductor) alike
_all_gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor


# The group the tokens split over (None: every process). A module global: compiled blocks read it as a constant.
_GROUP = None
_SEQUENCE_GROUPS: dict = {}  # processes per group -> this process's group


@contextlib.contextmanager
def over(group):
    """Sequence splits inside run over `group` (None: every process)."""
    global _GROUP
    previous, _GROUP = _GROUP, group
    try:
        yield
    finally:
        _GROUP = previous


def sequence_groups(size: int):
    """This process's group of `size` consecutive ranks, the world cut into such groups (made once, by every process
    at the same point of the same call: creating groups is collective)."""
    if size not in _SEQUENCE_GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world, size)]
        _SEQUENCE_GROUPS[size] = groups[rank // size]
    return _SEQUENCE_GROUPS[size]


def forget_sequence_groups() -> None:
    """Before the process leaves its group: the subgroups go with it."""
    _SEQUENCE_GROUPS.clear()


def _group():
    return _GROUP if _GROUP is not None else dist.group.WORLD


def rank_and_world() -> tuple:
    """This process's rank in the group the tokens split over, and its size."""
    group = _group()
    return dist.get_rank(group), dist.get_world_size(group)


def why_not_shard(tokens: int, world: int) -> str | None:
    """Why `tokens` cannot be split over `world` processes (None: they can)."""
    if tokens % world:
        return f"its {tokens} image tokens do not divide over {world} processes"
    return None


def attention_split(heads: int, world: int) -> str:
    """How the attention of `heads` heads runs over `world` shards: "ulysses" (heads traded for tokens) where the
    heads divide, else "gathered keys"."""
    return "ulysses" if heads % world == 0 else "gathered keys"


def shard(tensor: torch.Tensor, dim: int, rank: int, world: int, lead: int = 0) -> torch.Tensor:
    """The first `lead` entries of `dim` (text, whole on every rank) and this rank's contiguous shard of the rest, in
    a tensor of its own with standard strides: a view's storage offset and strides differ by rank and from the
    blocks' own outputs, and compiled blocks guard on them (a recompile each)."""
    size = (tensor.shape[dim] - lead) // world
    part = tensor.narrow(dim, lead + rank * size, size)
    if lead:
        return torch.cat((tensor.narrow(dim, 0, lead), part), dim)
    return part.clone(memory_format=torch.contiguous_format)


def gather(tensor: torch.Tensor, dim: int, lead: int = 0) -> torch.Tensor:
    """The inverse of `shard`: the first `lead` entries as they are, then every rank's shard in rank order."""
    rest = tensor.narrow(dim, lead, tensor.shape[dim] - lead)
    gathered = all_gather(rest, dim)
    return torch.cat((tensor.narrow(dim, 0, lead), gathered), dim) if lead else gathered


def all_gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's `tensor`, concatenated along `dim` in rank order."""
    return _all_gather(tensor.movedim(dim, 0).contiguous(), 0, _group()).movedim(0, dim)


def _exchange(grouped: torch.Tensor) -> torch.Tensor:
    """all-to-all over the first dimension: slice r goes to rank r, and slice r of the result came from rank r."""
    return functional.all_to_all_single(grouped.contiguous(), None, None, _group())


def tokens_to_heads(x: torch.Tensor, world: int) -> torch.Tensor:
    """(batch, heads, tokens / world, d) on each rank -> (batch, heads / world, tokens, d): all tokens, this rank's
    heads."""
    b, h, s, d = x.shape
    grouped = x.reshape(b, world, h // world, s, d).transpose(0, 1)
    return _exchange(grouped).permute(1, 2, 0, 3, 4).reshape(b, h // world, world * s, d)


def heads_to_tokens(x: torch.Tensor, world: int) -> torch.Tensor:
    """The inverse of `tokens_to_heads`: (batch, heads / world, tokens, d) -> (batch, heads, tokens / world, d)."""
    b, h, s, d = x.shape
    grouped = x.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4)
    return _exchange(grouped).transpose(0, 1).reshape(b, world * h, s // world, d)


def sharded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend, text: int = 0) -> torch.Tensor:
    """Attention over every rank's tokens, as `ulysses_attention` takes and returns it, by Ulysses where the heads
    divide over the ranks and by gathered keys and values where they do not."""
    if attention_split(q.shape[1], rank_and_world()[1]) == "ulysses":
        return ulysses_attention(q, k, v, attend, text)
    return gathered_keys_attention(q, k, v, attend, text)


def gathered_keys_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend, text: int = 0) -> torch.Tensor:
    """`ulysses_attention`'s result for any number of heads: this rank's queries (the text's too, computed on every
    rank) over the text's keys and values and every rank's image tokens'."""
    def every_ranks(t):
        return torch.cat((t[:, :, :text], all_gather(t[:, :, text:], 2)), dim=2) if text else all_gather(t, 2)
    return attend(q, every_ranks(k), every_ranks(v))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend, text: int = 0) -> torch.Tensor:
    """Attention over every rank's tokens. q, k, v: (batch, heads, text + this rank's image tokens, d), the first
    `text` tokens the same on every rank; `attend(q, k, v)` runs the attention itself on (batch, heads / world, text
    + all image tokens, d). Returns (batch, heads, text + this rank's image tokens, d)."""
    rank, world = rank_and_world()
    h = q.shape[1] // world

    def this_ranks(t):  # its heads of the text, every rank's image tokens
        return torch.cat((t[:, rank * h:(rank + 1) * h, :text], tokens_to_heads(t[:, :, text:], world)), dim=2)
    out = attend(*(this_ranks(t) for t in (q, k, v)))
    image = heads_to_tokens(out[:, :, text:], world)
    if not text:
        return image
    return torch.cat((all_gather(out[:, :, :text], 1), image), dim=2)

"""A model call's tokens split over the processes of a torch.distributed group (sequence parallelism, Ulysses):
every process holds one contiguous shard of the image tokens through the blocks, and each attention call trades
shards of tokens for shards of heads with one all-to-all, attends over all tokens for its heads, and trades back.
Text tokens that join the image's in one attention (Flux, SD3, Qwen-Image) are whole on every process: each attends
with its own heads of them, and the heads are gathered after. Only the attention sees every token; everything else
in a block works token by token, so the shards are exact. The arithmetic only: where a front end shards, attends and
gathers is its own (nodes/sequence_parallel.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

# torch.distributed's functional collectives: eager, and traced into a compiled block's graph (Inductor) alike
_all_gather = getattr(functional, "all_gather_single", None) or functional.all_gather_tensor


def rank_and_world() -> tuple:
    return dist.get_rank(), dist.get_world_size()


def why_not_shard(tokens: int, heads: int, world: int) -> str | None:
    """Why `tokens` and `heads` cannot be split over `world` processes (None: they can)."""
    if tokens % world:
        return f"its {tokens} image tokens do not divide over {world} processes"
    if heads % world:
        return f"its {heads} attention heads do not divide over {world} processes (ring attention is not built)"
    return None


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
    return _all_gather(tensor.movedim(dim, 0).contiguous(), 0, dist.group.WORLD).movedim(0, dim)


def _exchange(grouped: torch.Tensor) -> torch.Tensor:
    """all-to-all over the first dimension: slice r goes to rank r, and slice r of the result came from rank r."""
    return functional.all_to_all_single(grouped.contiguous(), None, None, dist.group.WORLD)


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

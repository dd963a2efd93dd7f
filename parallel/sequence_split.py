"""A model call's tokens split over the processes of a torch.distributed group (sequence parallelism, Ulysses):
every process holds one contiguous shard of the image tokens through the blocks, and each attention call trades
shards of tokens for shards of heads with one all-to-all, attends over all tokens for its heads, and trades back.
Only the attention sees every token; everything else in a block works token by token, so the shards are exact.
The arithmetic only: where a front end shards, attends and gathers is its own (nodes/sequence_parallel.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank_and_world() -> tuple:
    return dist.get_rank(), dist.get_world_size()


def why_not_shard(tokens: int, heads: int, world: int) -> str | None:
    """Why `tokens` and `heads` cannot be split over `world` processes (None: they can)."""
    if tokens % world:
        return f"its {tokens} tokens do not divide over {world} processes"
    if heads % world:
        return f"its {heads} attention heads do not divide over {world} processes (ring attention is not built)"
    return None


def shard(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous shard of `dim` (which divides evenly)."""
    size = tensor.shape[dim] // world
    return tensor.narrow(dim, rank * size, size)


def gather(tensor: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Every rank's shard of `dim`, in rank order (the inverse of `shard`)."""
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=dim)


def _exchange(grouped: torch.Tensor) -> torch.Tensor:
    """all-to-all over the first dimension: slice r goes to rank r, and slice r of the result came from rank r."""
    out = torch.empty_like(grouped)
    dist.all_to_all_single(out, grouped)
    return out


def tokens_to_heads(x: torch.Tensor, heads: int, world: int) -> torch.Tensor:
    """(batch, tokens / world, heads × d) on each rank -> (batch, tokens, heads / world × d): all tokens, this rank's
    heads."""
    b, s, hd = x.shape
    d = hd // heads
    grouped = x.reshape(b, s, world, heads // world * d).permute(2, 0, 1, 3).contiguous()
    return _exchange(grouped).permute(1, 0, 2, 3).reshape(b, world * s, heads // world * d)


def heads_to_tokens(x: torch.Tensor, world: int) -> torch.Tensor:
    """The inverse of `tokens_to_heads`: (batch, tokens, heads / world × d) -> (batch, tokens / world, heads × d)."""
    b, s, hd = x.shape
    grouped = x.reshape(b, world, s // world, hd).permute(1, 0, 2, 3).contiguous()
    return _exchange(grouped).permute(1, 2, 0, 3).reshape(b, s // world, world * hd)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, attend) -> torch.Tensor:
    """Self-attention over every rank's tokens, q, k, v being this rank's shard in (batch, tokens, heads × d);
    `attend(q, k, v, heads)` runs the attention itself on (batch, all tokens, heads / world × d)."""
    world = dist.get_world_size()
    q, k, v = (tokens_to_heads(t, heads, world) for t in (q, k, v))
    return heads_to_tokens(attend(q, k, v, heads // world), world)

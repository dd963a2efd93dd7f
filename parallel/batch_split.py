"""A model call's batch split into parts and joined back: the arithmetic of batch (CFG) parallelism, apart from any
transport. A call's batch holds `chunks` equal chunks (ComfyUI: one per entry of `cond_or_uncond`, the conditional
and the unconditional pass); parts never cut a chunk."""
from __future__ import annotations

import torch


def chunk_ranges(chunks: int, parts: int) -> list:
    """[(first chunk, end chunk)] for each part: as even as whole chunks allow, none empty (parts ≤ chunks)."""
    if not 1 <= parts <= chunks:
        raise ValueError(f"cannot split {chunks} chunk(s) of a batch into {parts} parts: at most one part per chunk")
    edges = [round(i * chunks / parts) for i in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _part_of(value, batch: int, chunks: int, first: int, end: int):
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == batch:
        rows = batch // chunks
        return value[first * rows:end * rows]
    if (isinstance(value, (list, tuple)) and len(value) == chunks
            and not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in value)):  # an entry per chunk
        return type(value)(value[first:end])
    if isinstance(value, dict):
        return {k: _part_of(v, batch, chunks, first, end) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_part_of(v, batch, chunks, first, end) for v in value)
    return value


def split_call(x: torch.Tensor, timestep: torch.Tensor, kwargs: dict, chunks: int, parts: int) -> list:
    """[(x, timestep, kwargs)] for each part: every tensor whose first dimension is the batch is sliced, every list of
    plain entries, one per chunk, too; anything else is shared."""
    batch = x.shape[0]
    if batch % chunks:
        raise ValueError(f"a batch of {batch} rows does not hold {chunks} equal chunks")
    return [tuple(_part_of(v, batch, chunks, first, end) for v in (x, timestep, kwargs))
            for first, end in chunk_ranges(chunks, parts)]


def join(outputs: list) -> torch.Tensor:
    return torch.cat(outputs, dim=0)

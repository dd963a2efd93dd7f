"""Low-rank terms (LoRAs) beside a quantized layer: y = Q(W)x + up((down x) * scale).

A LoRA baked into 8-bit weights costs a re-quantization of every layer it touches at each change of strength, from
float weights that must be on the GPU for it (on a short card, copied in from host memory first); rounding keeps the
LoRA's effect either way (bench/probes/lora_bake_probe.py). Beside the layer its strengths are values in `scale`, written in
place: a compiled graph, and a CUDA graph recorded over these buffers, run every strength and every LoRA of the same
total rank without recompiling, recording again or quantizing anything (Nunchaku runs LoRAs beside its 4-bit layers the
same way).

Several LoRAs stack along the rank: `down` holds each term's down-projection (alpha / rank folded in), `up` its
up-projection placed at the output rows the term patches (a slice of a fused qkv layer), `scale` each rank row's
strength. The rank is padded to a bucket (`rank_bucket`), so that another LoRA of a similar rank fits the same buffers.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from .modules import QuantConv2d1x1, gemm_of

MIN_RANK = 32  # the smallest bucket: most LoRAs are rank 4-16, and one bucket serves two of them stacked


@dataclasses.dataclass(frozen=True)
class LowRankTerm:
    """One LoRA's term on one layer: delta W[rows, cols] = strength * up @ down (alpha / rank already in `down`'s
    scale factor `factor`). `rows` / `cols`: the (start, size) of the layer's output / input the term patches (None: all
    of them, the usual case; Flux's fused qkv takes a LoRA's q, k and v as three slices)."""

    up: torch.Tensor     # (rows, rank)
    down: torch.Tensor   # (rank, cols)
    strength: float      # the LoRA's strength times alpha / rank
    rows: tuple | None = None
    cols: tuple | None = None

    @property
    def rank(self) -> int:
        return self.down.shape[0]


def layer_shape(layer: nn.Module) -> tuple:
    """(out, in) of a quantized layer's GEMM (a 1x1 conv's over its channels)."""
    gemm = gemm_of(layer)
    return gemm.out_features, gemm.in_features


def total_rank(terms) -> int:
    return sum(term.rank for term in terms)


def rank_bucket(rank: int) -> int:
    """The buffers' rank for `rank` rows of terms: a power of two, at least MIN_RANK."""
    bucket = MIN_RANK
    while bucket < rank:
        bucket *= 2
    return bucket


class LowRankSidePath(nn.Module):
    """A quantized layer (`base`, shared with the model's other clones) and its low-rank terms' buffers. The base runs
    its plain GEMM: an MLP's fused fp8 path (gelu_fusion.py) would apply GELU before the terms are added."""

    def __init__(self, base: nn.Module, rank: int, dtype: torch.dtype):
        super().__init__()
        self.base = base
        gemm = gemm_of(base)
        device = gemm.weight_q.device if gemm.weight_q is not None else None
        self.rank = int(rank)
        self.register_buffer("down", torch.zeros(rank, gemm.in_features, dtype=dtype, device=device))
        self.register_buffer("up", torch.zeros(gemm.out_features, rank, dtype=dtype, device=device))
        self.register_buffer("scale", torch.zeros(rank, dtype=dtype, device=device))

    @property
    def in_features(self) -> int:
        return gemm_of(self.base).in_features

    @property
    def out_features(self) -> int:
        return gemm_of(self.base).out_features

    def _gemm(self, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = gemm_of(self.base).gemm(rows, out_dtype)
        low = F.linear(rows.to(self.down.dtype), self.down) * self.scale
        if out.dtype == low.dtype:  # the up-projection accumulates into the layer's output: one pass over it, not three
            return torch.addmm(out, low, self.up.t())
        return out + F.linear(low, self.up).to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.base, QuantConv2d1x1):
            return self.base._run(x, self._gemm)
        shape = x.shape
        y = self._gemm(x.reshape(-1, self.in_features), x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    @torch.no_grad()
    def write(self, terms) -> None:
        """These terms in place of the ones written before (in place: graphs that captured the buffers read them).
        Raises ValueError where they do not fit the buffers' rank or the layer's shape; nothing is written then."""
        if total_rank(terms) > self.rank:
            raise ValueError(f"low-rank terms of total rank {total_rank(terms)} do not fit buffers of rank {self.rank}")
        n, k = self.up.shape[0], self.down.shape[1]
        for term in terms:
            rows, cols = term.rows or (0, n), term.cols or (0, k)
            if term.up.shape != (rows[1], term.rank) or term.down.shape != (term.rank, cols[1]) or \
                    rows[0] + rows[1] > n or cols[0] + cols[1] > k:
                raise ValueError(f"a low-rank term of shapes {tuple(term.up.shape)} x {tuple(term.down.shape)} at rows "
                                 f"{rows}, columns {cols} does not fit a {n} x {k} layer")
        self.down.zero_()
        self.up.zero_()
        start = 0
        for term in terms:  # in place, where the buffers are: no host copy of the layer's size
            (row, rows), (col, cols) = term.rows or (0, n), term.cols or (0, k)
            end = start + term.rank
            self.down[start:end, col:col + cols].copy_(term.down.detach())
            self.up[row:row + rows, start:end].copy_(term.up.detach())
            start = end
        self.write_strengths([(term.rank, term.strength) for term in terms])

    def buffers_to(self, device) -> None:
        """Its own buffers onto `device` (its layer moves with the model)."""
        for name in ("down", "up", "scale"):
            self._buffers[name] = self._buffers[name].to(device)

    @torch.no_grad()
    def write_strengths(self, strengths) -> None:
        """New strengths for the terms written last (one per term, in their order), without touching their factors."""
        scale = torch.zeros(self.rank, dtype=torch.float32)
        start = 0
        for rank, strength in strengths:
            scale[start:start + rank] = strength
            start += rank
        self.scale.copy_(scale, non_blocking=True)

    def extra_repr(self) -> str:
        return f"rank={self.rank}"


def base_of(module: nn.Module) -> nn.Module:
    """The quantized layer a module runs: a side path's layer, or the module itself."""
    return module.base if isinstance(module, LowRankSidePath) else module


def side_path_reference(base_weight: torch.Tensor, terms) -> torch.Tensor:
    """The float weight that `terms` beside a layer of float weight `base_weight` stand for (tests and the report's
    error figures): W + sum(strength * up @ down) at each term's slice."""
    weight = base_weight.detach().float().reshape(base_weight.shape[0], -1).clone()
    for term in terms:
        rows, cols = term.rows or (0, weight.shape[0]), term.cols or (0, weight.shape[1])
        weight[rows[0]:rows[0] + rows[1], cols[0]:cols[0] + cols[1]] += term.strength * (term.up.float()
                                                                                          @ term.down.float())
    return weight

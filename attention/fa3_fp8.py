"""FlashAttention-3's fp8 forward kernel (the `fa3-fwd` wheel) with K and V smoothed, as an 8-bit backend of the
chooser.

The kernel takes e4m3 Q, K, V with one descale per (batch, head) and writes bf16. Cast as they come, trained models'
K and V lose most of e4m3's range to offsets shared by all tokens of a channel, so both are smoothed first; each
step is exact in real arithmetic:
- K minus its mean over the tokens (per head and channel): q·(k - k̄) = q·k - q·k̄, and q·k̄ is the same for every
  key of a query row, so the softmax does not change.
- V minus its mean over the tokens: every output row is a convex combination of V's rows, so the output is the
  attention over (V - v̄) plus v̄, added back in 16 bits.
Each (batch, head)'s scale maps the largest magnitude of the smoothed tensor to 448 (e4m3's largest), from per
channel sums, maxima and minima taken in one pass, so the cast never clips and no scale is carried between calls.

Two Triton launches around the kernel (the statistics of Q, K, V; the casts into the tokens-major layout the kernel
reads) and one add. No host sync, so CUDA graphs record it; the chooser measures its error on each model's inputs.
"""
from __future__ import annotations

import torch

from . import fa3
from ..quantization.kernels import FP8_MAX
from .triton8 import _token_block, triton

BLOCK = 64  # tokens per program of the casts, and per step of the statistics' loop
# Programs the statistics pass aims at (a few waves of an H200's 132 SMs): the steps per program grow from 1 to 16 as
# the tokens do, so a short sequence keeps its parallelism and a long one its atomics few.
STATS_PROGRAMS = 2048
STATS = 5  # rows of `peaks`: K's max and -min, V's max and -min, Q's largest magnitude (per batch*head, channel)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _stats_kernel(q_ptr, k_ptr, v_ptr, sums_ptr, peaks_ptr, n_q, n_kv, heads, n_bh, q_strides, k_strides,
                      v_strides, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
        """BLOCKS blocks of tokens per program, reduced in registers, then atomically into sums (2, bh, dim; zeroed):
        K's and V's sums over the tokens; into peaks (5, bh, dim; -inf before): K's and V's maxima and negated
        minima, Q's largest magnitude per channel (one atomic per channel and program: per block they cost more
        than the reads)."""
        pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        cols = tl.arange(0, HEAD_DIM)
        at = bh * HEAD_DIM + cols
        plane = n_bh * HEAD_DIM
        n = n_q if which == 0 else n_kv
        total = tl.zeros([HEAD_DIM], tl.float32)
        top = tl.full([HEAD_DIM], -float("inf"), tl.float32)
        bottom = tl.full([HEAD_DIM], -float("inf"), tl.float32)
        for block in range(BLOCKS):
            rows = ((pid * BLOCKS + block) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
            valid = (rows < n)[:, None]
            if which == 0:
                x = tl.load(_token_block(q_ptr, q_strides, bh, heads, rows, cols), mask=valid, other=0.0)
            elif which == 1:
                x = tl.load(_token_block(k_ptr, k_strides, bh, heads, rows, cols), mask=valid, other=0.0)
            else:
                x = tl.load(_token_block(v_ptr, v_strides, bh, heads, rows, cols), mask=valid, other=0.0)
            x = x.to(tl.float32)
            total += tl.sum(x, axis=0)
            top = tl.maximum(top, tl.max(tl.where(valid, x, -float("inf")), axis=0))
            bottom = tl.maximum(bottom, tl.max(tl.where(valid, -x, -float("inf")), axis=0))
        if which == 0:
            tl.atomic_max(peaks_ptr + 4 * plane + at, tl.maximum(top, bottom), sem="relaxed")
        else:
            side = (which - 1) * 2 * plane
            tl.atomic_add(sums_ptr + (which - 1) * plane + at, total, sem="relaxed")
            tl.atomic_max(peaks_ptr + side + at, top, sem="relaxed")
            tl.atomic_max(peaks_ptr + side + plane + at, bottom, sem="relaxed")

    @triton.jit
    def _cast_kernel(q_ptr, k_ptr, v_ptr, sums_ptr, peaks_ptr, q8_ptr, k8_ptr, v8_ptr, descale_ptr, v_mean_ptr, n_q,
                     n_kv, heads, n_bh, q_strides, k_strides, v_strides, FP8_MAX: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """Q, K - k̄, V - v̄ of one block of tokens over their (batch, head)'s scale into e4m3, (batch, tokens,
        heads, dim); the first program of each writes the descale (3, batch*head) and V's mean (batch*head, dim)."""
        pid, bh, which = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        at = bh * HEAD_DIM + cols
        plane = n_bh * HEAD_DIM
        if which == 0:
            n = n_q
            mean = tl.zeros([HEAD_DIM], tl.float32)
            peak = tl.max(tl.load(peaks_ptr + 4 * plane + at), axis=0)
        else:
            n = n_kv
            mean = tl.load(sums_ptr + (which - 1) * plane + at) / n_kv
            side = (which - 1) * 2 * plane
            above = tl.load(peaks_ptr + side + at) - mean
            below = tl.load(peaks_ptr + side + plane + at) + mean
            peak = tl.max(tl.maximum(above, below), axis=0)
        descale = tl.maximum(peak / FP8_MAX, 1e-20)
        valid = (rows < n)[:, None]
        if which == 0:
            x = tl.load(_token_block(q_ptr, q_strides, bh, heads, rows, cols), mask=valid, other=0.0)
            dst = q8_ptr
        elif which == 1:
            x = tl.load(_token_block(k_ptr, k_strides, bh, heads, rows, cols), mask=valid, other=0.0)
            dst = k8_ptr
        else:
            x = tl.load(_token_block(v_ptr, v_strides, bh, heads, rows, cols), mask=valid, other=0.0)
            dst = v8_ptr
        scaled = tl.minimum(tl.maximum((x.to(tl.float32) - mean[None, :]) / descale, -FP8_MAX), FP8_MAX)
        b, h = bh // heads, bh % heads
        out = dst + ((b * n + rows) * heads + h)[:, None] * HEAD_DIM + cols[None, :]
        tl.store(out, scaled.to(dst.dtype.element_ty), mask=valid)
        if pid == 0:
            tl.store(descale_ptr + which * n_bh + bh, descale)
            if which == 2:
                tl.store(v_mean_ptr + at, mean.to(v_mean_ptr.dtype.element_ty))


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """None where the backend runs (batch, heads, tokens, head dim) q, k, v, else why not."""
    if triton is None:
        return "Triton is not installed"
    missing = fa3.unavailable(q)
    if missing is not None:
        return missing
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16 inputs of one dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] not in (64, 128, 256) or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (the fp8 kernels of the fa3-fwd wheel take 64, 128 and 256)"
    return None


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(q8, k8, v8 as (batch, tokens, heads, dim) e4m3; descales (3, batch, heads) float32; V's mean (batch, 1,
    heads, dim) in V's dtype) of (batch, heads, tokens, dim) q, k, v."""
    batch, heads, n_q, dim = q.shape
    n_kv, n_bh = k.shape[2], batch * heads
    device = q.device
    sums = torch.zeros((2, n_bh, dim), dtype=torch.float32, device=device)
    peaks = torch.full((STATS, n_bh, dim), -float("inf"), dtype=torch.float32, device=device)
    strides = [(t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v)]
    blocks = triton.cdiv(max(n_q, n_kv), BLOCK)
    steps = min(16, triton.next_power_of_2(max(1, blocks * n_bh * 3 // STATS_PROGRAMS)))
    _stats_kernel[(triton.cdiv(blocks, steps), n_bh, 3)](q, k, v, sums, peaks, n_q, n_kv, heads, n_bh, *strides,
                                                         HEAD_DIM=dim, BLOCK=BLOCK, BLOCKS=steps)
    grid = (blocks, n_bh, 3)
    q8 = torch.empty((batch, n_q, heads, dim), dtype=torch.float8_e4m3fn, device=device)
    k8, v8 = (torch.empty((batch, n_kv, heads, dim), dtype=torch.float8_e4m3fn, device=device) for _ in range(2))
    descale = torch.empty((3, batch, heads), dtype=torch.float32, device=device)
    v_mean = torch.empty((batch, 1, heads, dim), dtype=v.dtype, device=device)
    _cast_kernel[grid](q, k, v, sums, peaks, q8, k8, v8, descale, v_mean, n_q, n_kv, heads, n_bh, *strides,
                       FP8_MAX=FP8_MAX, HEAD_DIM=dim, BLOCK=BLOCK)
    return q8, k8, v8, descale, v_mean


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head dim) q, k, v -> (batch, tokens, heads, head dim) in q's dtype."""
    q8, k8, v8, descale, v_mean = quantize(q, k, v)
    out = torch.ops.fa3_fwd._flash_attn_forward(q8, k8, v8, q_descale=descale[0], k_descale=descale[1],
                                                v_descale=descale[2], softmax_scale=q.shape[-1] ** -0.5)[0]
    return out.add_(v_mean).to(q.dtype)  # bf16: q's dtype but for fp16 inputs

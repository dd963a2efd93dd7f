"""Fused Triton kernels for the EAGER CUDA path of the quantized linears (under torch.compile, Inductor generates
equivalent fused code from the plain torch ops in kernels.py, which then also fuse with neighbouring ops).

Without them, eager activation quantization is ~7 separate memory-bound kernels (abs, amax, divide, round, clamp,
cast, ...) and the int8 rescale 5 more, which costs several times the GEMM itself. Here each is one kernel:
- `quantize_rows_int8(x)`: per-row amax, scale = amax / 127, quantize (round half to even, the same as
  torch.round), one read of x, one write of q.
- `rescale(acc, x_scale, w_scale, bias, out_dtype)`: y = acc * x_scale * w_scale + bias, cast, one pass.
- `quantize_tensor_fp8(x)`: one scale for the whole tensor: torch.aminmax (one reduction, no |x| copy), then one
  kernel that turns it into the scale and casts x to e4m3; `quantize_tensor_fp8_static(x, inverse_scale)`: that
  kernel alone, with a given (calibrated) scale's reciprocal.
- `dequantize_int4_fp8(packed, ratios)`: an int4 layer's e4m3 weight for its fp8 GEMM, one read of the codes and
  ratios, one write.
- `weight_only_matmul(x, w_int8, w_scale, bias, out_dtype)`: up to `WEIGHT_ONLY_MAX_ROWS` rows of x times an int8
  weight, compiled or not (kernels.weight_only_linear calls it through a custom op): the time of such a call is
  reading the weight, and Inductor's own reduction for it read Flux's modulation weights at 0.5-1 TB/s on an H100
  (`2026-11-26_h100_flux_1024_fp8_profile.json`); for a text stream's hundred-odd rows (Qwen-Image's, with CFG)
  the alternative, an int8-to-bf16 copy of the weight and a bf16 GEMM, moves 5 bytes per weight instead of 1.

Numerics match the torch ops in kernels.py: float casts round to nearest even on the GPU, as torch's do. Tests run
the kernels through Triton's interpreter (TRITON_INTERPRET=1) on CPU; the interpreter's own fp8/bf16 casts round
differently (truncation, a lost carry at powers of two), so only int8/fp16/fp32 results are compared exactly there.
`OVERDRIVE_QUANT_TRITON=0` turns them off.
"""
from __future__ import annotations

import os

import torch

from .numerics import EPS, FP8_DTYPE, FP8_MAX, INT4_TO_FP8, INT8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

AVAILABLE = triton is not None and os.environ.get("OVERDRIVE_QUANT_TRITON", "1") != "0"

if triton is not None:
    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, QMAX: tl.constexpr, EPS: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        q_row = q_ptr + row * stride_q
        offs = tl.arange(0, BLOCK_K)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            mask = start + offs < K
            x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / QMAX, EPS)
        for start in range(0, K, BLOCK_K):
            mask = start + offs < K
            y = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32) / scale
            r = tl.floor(y + 0.5)
            tie = (r - y) == 0.5
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
            y = tl.where(tie & odd, r - 1.0, r)
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            tl.store(q_row + start + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _rescale_kernel(acc_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, stride_acc, stride_out,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < M
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        y = tl.load(acc_ptr + rows64[:, None] * stride_acc + cols[None, :], mask=mask, other=0).to(tl.float32)
        xs = tl.load(xs_ptr + rows, mask=rmask, other=0.0)
        ws = tl.load(ws_ptr + cols, mask=cmask, other=0.0)
        y = y * xs[:, None] * ws[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
        out = out_ptr + rows64[:, None] * stride_out + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_tensor_kernel(x_ptr, q_ptr, s_ptr, min_ptr, max_ptr, n, QMAX: tl.constexpr, EPS: tl.constexpr,
                                BLOCK: tl.constexpr, STATIC: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if STATIC:  # 1 / the scale is given
            y = x * tl.load(s_ptr)
        else:
            amax = tl.maximum(-tl.load(min_ptr).to(tl.float32), tl.load(max_ptr).to(tl.float32))
            scale = tl.maximum(amax / QMAX, EPS)
            y = x / scale
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=mask)
        if not STATIC:
            if pid == 0:
                tl.store(s_ptr, scale)


    @triton.jit
    def _dequantize_int4_kernel(packed_ptr, ratio_ptr, out_ptr, n_bytes, half_k, groups, GROUP: tl.constexpr,
                                SCALE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_bytes
        byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
        row = offs // half_k
        group = (offs % half_k) * 2 // GROUP
        ratio = tl.load(ratio_ptr + row * groups + group, mask=mask, other=0.0).to(tl.float32) * SCALE
        low = ((byte & 15) - 8).to(tl.float32) * ratio
        high = ((byte >> 4) - 8).to(tl.float32) * ratio
        tl.store(out_ptr + 2 * offs, low.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + 2 * offs + 1, high.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _weight_only_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """out[rows, cols] = (x[rows] @ w_int8[cols]ᵀ) * scale[cols] + bias[cols]: one program per BLOCK_M rows and
        BLOCK_N output channels, streaming their weight rows once; the row blocks of one weight tile are neighbours in
        the grid, so a second one finds it in L2. Rows are padded to BLOCK_M (a tensor-core tile), exact since int8
        values are exact in 16 bits."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
        w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
        for start in range(0, K, BLOCK_K):
            ks = start + offs
            x = tl.load(x_rows + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        cmask = cols < N
        y = acc * tl.load(s_ptr + cols, mask=cmask, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & cmask[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the weight-only kernel by the most rows they serve, from
# bench/probes/quantize_gemv.py's sweep (`2026-11-26_h100_quantize_gemv_rows.json`). At Qwen-Image's text stream with CFG it
# is slower than bf16 cuBLAS but faster than the compiled dequantizing path (a fused int8-to-bf16 copy, then cuBLAS);
# at twice those rows they tie, above it the GEMM wins.
WEIGHT_ONLY_CONFIGS = {16: (16, 64, 256, 4, 3), 64: (16, 64, 256, 4, 4), 128: (64, 64, 256, 4, 3)}
WEIGHT_ONLY_MAX_ROWS = max(WEIGHT_ONLY_CONFIGS)


def weight_only_config(rows: int):
    """The kernel's configuration for a call with this many rows."""
    fitting = [most for most in WEIGHT_ONLY_CONFIGS if most >= rows]
    return WEIGHT_ONLY_CONFIGS[min(fitting) if fitting else WEIGHT_ONLY_MAX_ROWS]


def weight_only_matmul(x: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype, config=None) -> torch.Tensor:
    """(M, K) fp16/bf16 x, (N, K) int8 weight, (1, N) float32 scales -> (M, N) in out_dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    block_m, block_n, block_k, warps, stages = config or weight_only_config(m)
    n = w_int8.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    scale = w_scale.reshape(-1)
    _weight_only_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, w_int8, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), w_int8.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)  # without a bias, the scales stand in for the pointer, never read
    return out


def dequantize_int4_fp8(packed: torch.Tensor, ratios: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 codes, (N, K/group) float16 ratios -> (N, K) float8_e4m3fn (kernels.dequantize_int4_fp8)."""
    n, half_k = packed.shape
    out = torch.empty((n, 2 * half_k), dtype=FP8_DTYPE, device=packed.device)
    if packed.numel():
        block = 2048
        _dequantize_int4_kernel[(triton.cdiv(packed.numel(), block),)](
            packed.contiguous(), ratios.contiguous(), out, packed.numel(), half_k, ratios.shape[1],
            GROUP=2 * half_k // ratios.shape[1], SCALE=INT4_TO_FP8, BLOCK=block, num_warps=8)
    return out


def quantize_tensor_fp8(x: torch.Tensor):
    """(M, K) float -> (float8_e4m3fn (M, K), float32 scale (1, 1)), one dynamic scale for the tensor."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((1, 1), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return q, scale.fill_(EPS)
    low, high = torch.aminmax(x)
    _cast_fp8(x, q, scale, low, high, static=False)
    return q, scale


def quantize_tensor_fp8_static(x: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    """(M, K) float, 1 / the float32 scale (1, 1) -> float8_e4m3fn (M, K), one kernel."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if x.numel():
        inverse = inverse_scale.float().reshape(1).contiguous()
        _cast_fp8(x, q, inverse, inverse, inverse, static=True)  # min/max pointers are unused when static
    return q


def _cast_fp8(x, q, scale, low, high, static: bool):
    block = 4096
    _quantize_tensor_kernel[(triton.cdiv(x.numel(), block),)](x, q, scale, low, high, x.numel(), QMAX=FP8_MAX,
                                                              EPS=EPS, BLOCK=block, STATIC=static, num_warps=8)


def quantize_rows_int8(x: torch.Tensor):
    """(M, K) float -> (int8 (M, K), float32 scale (M, 1)), one fused kernel."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(triton.next_power_of_2(max(k, 16)), 2048)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=INT8_MAX, EPS=EPS, BLOCK_K=block,
                                num_warps=4 if block <= 1024 else 8)
    return q, scale


def rescale(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    """(acc * x_scale * w_scale + bias).to(out_dtype) in one pass; scales (M, 1) and (1, N) float32, bias optional."""
    if acc.stride(-1) != 1:
        acc = acc.contiguous()
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, 64), triton.cdiv(n, 64))
    _rescale_kernel[grid](acc, x_scale.reshape(-1), w_scale.reshape(-1), bias if bias is not None else acc, out, m, n,
                          acc.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=64, BLOCK_N=64,
                          num_warps=4)  # without a bias, acc stands in for the pointer and is never read
    return out

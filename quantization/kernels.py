"""Low-precision GEMM kernels and the quantizers that feed them (plain torch, torch.compile-friendly).

Schemes (symmetric, no zero points):
- int8 W8A8: weights per output channel, scale = amax(row) / 127; activations per token (row), dynamic,
  scale = amax(row) / 127; `torch._int_mm` int8 x int8 -> int32; then y = acc * s_x * s_w (+ bias) in float32.
- int4 weights for fp8 GEMMs (formats/int4.py): 4-bit integers with a scale per group of `INT4_GROUP` input channels,
  stored as the groups' ratios to the tensor's largest scale; before each GEMM one elementwise pass turns them into
  e4m3 weights (q x ratio x `INT4_TO_FP8`, each an exact-enough e4m3 value) for the fp8 path below.
- fp8 e4m3: one scale per tensor, scale = amax / 448 for the weight; for the activation either a static scale set
  from the amax seen in calibration times `STATIC_HEADROOM` (the default), or a dynamic one (amax of each input);
  `torch._scaled_mm` with tensor-wise scales (cuBLASLt): output in the model's dtype with the bias added inside the
  GEMM. A static scale makes the activation cast elementwise, so under torch.compile Inductor fuses it into the
  kernel that produces the input (which then writes fp8: half the bytes); a dynamic scale needs a reduction over
  the whole input first, which cost about what the fp8 GEMM saves on SDXL's layers. Row-wise scales were measured
  first: their kernels only write bf16, and the cast + bias pass that followed cost more than the fp8 GEMM saved
  (bench/EXPERIMENTS.md). A floating-point format keeps its relative precision across
  the range, so one scale per tensor loses little against row-wise scales (tests bound the error).

Kernel constraints (CUDA): `_int_mm` needs M > 16 and K, N multiples of 8; `_scaled_mm` needs K, N multiples of
16. Rows (M) are padded here when needed; K/N are checked once at decision time (`QuantFormat.shape_problem`) and such
layers are skipped with the reason logged.

No function here calls `.item()` or branches on tensor values, so activation quantization fuses with its
neighbours under torch.compile. The `reference_*` functions (dequantize, then float matmul) are the CPU test
oracle only and never the GPU path.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from . import triton_kernels
from .numerics import (EPS, FP8_DTYPE, FP8_MAX, INT4_CLIPS, INT4_GROUP, INT4_MAX, INT4_TO_FP8,  # noqa: F401
                       INT8_MAX, INT_MM_MIN_ROWS, STATIC_HEADROOM)

log = logging.getLogger("overdrive.quantization")


# ----------------------------------------------------------------------------------------------- weights
def quantize_weight_int8(weight: torch.Tensor):
    """(N, K) float -> (int8 (N, K), float32 scale (1, N)); per output channel, symmetric."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=EPS)
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.reshape(1, -1).contiguous()


def quantize_weight_fp8(weight: torch.Tensor):
    """(N, K) float -> (float8_e4m3fn (N, K), float32 scale (1, 1)); one scale for the tensor, symmetric."""
    w = weight.detach().float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=EPS).reshape(1, 1)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale


def quantize_weight_int4(weight: torch.Tensor, group: int = INT4_GROUP, rows_per_pass: int = 1 << 22):
    """(N, K) float -> (uint8 (N, K/2): two 4-bit codes a byte, code = q + 8, even k in the low nibble; float32 scale
    (1, 1) of the e4m3 weights `dequantize_int4_fp8` makes; float16 (N, K/group) ratios of each group's scale to the
    tensor's largest). Per group, the clipping of INT4_CLIPS with the least squared error. `rows_per_pass` bounds the
    float32 temporaries (elements) on a short card."""
    n, k = weight.shape
    step = max(1, rows_per_pass // k)
    codes, scales = [], []
    for start in range(0, n, step):
        w = weight[start:start + step].detach().float().reshape(-1, k // group, group)
        amax = w.abs().amax(-1, keepdim=True).clamp(min=EPS)
        best_q, best_scale, best_error = None, None, None
        for clip in INT4_CLIPS:
            scale = amax * (clip / INT4_MAX)
            q = torch.round(w / scale).clamp(-INT4_MAX - 1, INT4_MAX)
            error = (q * scale - w).square().sum(-1, keepdim=True)
            if best_q is None:
                best_q, best_scale, best_error = q, scale, error
            else:
                better = error < best_error
                best_q = torch.where(better, q, best_q)
                best_scale = torch.where(better, scale, best_scale)
                best_error = torch.minimum(error, best_error)
        code = (best_q + 8).to(torch.uint8).reshape(-1, k)
        codes.append(code[:, 0::2] | (code[:, 1::2] << 4))
        scales.append(best_scale.reshape(-1, k // group))
    scales = torch.cat(scales)
    largest = scales.amax().clamp(min=EPS)
    ratios = (scales / largest).to(torch.float16)
    return torch.cat(codes).contiguous(), (largest / INT4_TO_FP8).reshape(1, 1), ratios.contiguous()


def dequantize_int4_fp8(packed: torch.Tensor, ratios: torch.Tensor) -> torch.Tensor:
    """`quantize_weight_int4`'s codes and ratios -> the (N, K) e4m3 weight the fp8 GEMM takes with its scale."""
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, ratios.shape[1], -1)
    weight = (codes.float() - 8.0) * (ratios.float() * INT4_TO_FP8).unsqueeze(-1)
    return weight.reshape(n, k).to(FP8_DTYPE)


# ----------------------------------------------------------------------------------------------- activations
def _row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    # amax in the input's own dtype (exact), then float32 for the (M, 1) scales only: no float32 copy of x.
    return (x.abs().amax(dim=1, keepdim=True).float() / qmax).clamp(min=EPS)


def quantize_rows_int8(x: torch.Tensor):
    """(M, K) float -> (int8 (M, K), float32 scale (M, 1)); per row (token), dynamic, symmetric."""
    scale = _row_scale(x, INT8_MAX)
    q = torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # x / scale promotes to float32
    return q, scale


def quantize_tensor_fp8(x: torch.Tensor):
    """(M, K) float -> (float8_e4m3fn (M, K), float32 scale (1, 1)); one dynamic scale for the whole tensor."""
    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=EPS).reshape(1, 1)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def static_fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The static activation scale (float32 (1, 1)) for inputs whose calibration amax is `amax`."""
    return (amax.detach().float().reshape(1, 1) * STATIC_HEADROOM / FP8_MAX).clamp(min=EPS)


def quantize_tensor_fp8_static(x: torch.Tensor, inverse_scale: torch.Tensor) -> torch.Tensor:
    """(M, K) float, 1 / the fixed float32 scale (1, 1) -> float8_e4m3fn (M, K); elementwise (fuses with x's
    producer). A multiply, not a division: the division by a loaded scale made Inductor's fused cast after Flux's
    GELU 5 % slower on an H100 (bench/probes/gelu_epilogue.py, `2026-11-26_h100_gelu_epilogue.json`)."""
    return (x * inverse_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ----------------------------------------------------------------------------------------------- eager CUDA
_triton_state = {"ok": triton_kernels.AVAILABLE}


def _eager_triton(x: torch.Tensor) -> bool:
    """Fused Triton quantize/rescale kernels: only in eager mode on CUDA (under torch.compile Inductor fuses the
    plain torch ops below itself, together with the neighbouring ops)."""
    return not torch.compiler.is_compiling() and _triton_state["ok"] and x.is_cuda


def _triton_failed(error: Exception):
    _triton_state["ok"] = False
    log.warning("Overdrive quantization: fused Triton kernels unavailable (%s); plain torch ops run instead.", error)


def _eager_fused(fused, plain, x: torch.Tensor, *args):
    """`fused(x, *args)` (a Triton kernel) in eager CUDA mode, else `plain(x, *args)` (the torch ops); a Triton
    failure switches to the torch ops for good."""
    if _eager_triton(x):
        try:
            return fused(x, *args)
        except Exception as error:  # noqa: BLE001 - e.g. a Triton build problem: fall back, never fail the run
            _triton_failed(error)
    return plain(x, *args)


def _rescale(acc, x_scale, w_scale, bias, out_dtype):
    y = acc.float() * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ----------------------------------------------------------------------------------------------- GEMMs
def int8_linear(x2d: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """y = x @ W^T + b through `torch._int_mm`. x2d: (M, K) float; w_int8: (N, K) int8; w_scale: (1, N) fp32."""
    m = x2d.shape[0]
    xq, x_scale = _eager_fused(triton_kernels.quantize_rows_int8, quantize_rows_int8, x2d)
    if m < INT_MM_MIN_ROWS:  # a shape (not value) branch: a guard under torch.compile, never a graph break
        xq = F.pad(xq, (0, 0, 0, INT_MM_MIN_ROWS - m))
    acc = torch._int_mm(xq, w_int8.t())
    if m < INT_MM_MIN_ROWS:
        acc = acc[:m]
    return _eager_fused(triton_kernels.rescale, _rescale, acc, x_scale, w_scale, bias, out_dtype)


def fp8_linear(x2d: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype, fast_accum: bool = True, x_scale: torch.Tensor | None = None,
               x_inverse_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T + b through `torch._scaled_mm` with tensor-wise scales. x2d: (M, K) float; w_fp8: (N, K) e4m3;
    w_scale: (1, 1) float32; x_scale: the static activation scale (1, 1), or None for a dynamic one;
    x_inverse_scale: its reciprocal, kept by the caller (Fp8Linear) so that compiled code does not divide per element,
    else computed here."""
    if x_scale is None:
        xq, x_scale = _eager_fused(triton_kernels.quantize_tensor_fp8, quantize_tensor_fp8, x2d)
    else:
        if x_inverse_scale is None:
            x_inverse_scale = 1.0 / x_scale
        xq = _eager_fused(triton_kernels.quantize_tensor_fp8_static, quantize_tensor_fp8_static, x2d,
                          x_inverse_scale)
    return fp8_gemm(xq, x_scale, w_fp8, w_scale, bias, out_dtype, fast_accum)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, fast_accum: bool = True) -> torch.Tensor:
    """The GEMM of `fp8_linear` on an already quantized input: the scaling, the bias and the output cast happen
    inside it. Off the GPU, the same products summed in float32 by a float GEMM: torch's CPU fp8 GEMM runs so slowly
    that the CPU tests of the fp8 paths took hours; fp8 serves no CPU user, and the GPU tests run `torch._scaled_mm`
    itself."""
    if not xq.is_cuda:
        y = (xq.float() @ w_fp8.float().t()) * (x_scale.float() * w_scale.float()).reshape(())
        return (y if bias is None else y + bias.float()).to(out_dtype)
    fused_bias = bias is not None and out_dtype != torch.float32  # the fp8 GEMM adds a bias only for 16-bit outputs
    y = torch._scaled_mm(xq, w_fp8.t(), x_scale.reshape(()), w_scale.reshape(()),
                         bias=bias.to(out_dtype) if fused_bias else None, out_dtype=out_dtype,
                         use_fast_accum=fast_accum)
    if bias is not None and not fused_bias:
        y = y + bias
    return y


def int4_fp8_weight(packed: torch.Tensor, ratios: torch.Tensor) -> torch.Tensor:
    """`dequantize_int4_fp8`, one Triton kernel in eager CUDA mode (the torch ops are ~6 kernels over the weight)."""
    return _eager_fused(triton_kernels.dequantize_int4_fp8, dequantize_int4_fp8, packed, ratios)


def fp8_linear_gelu(x2d: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    x_scale: torch.Tensor, x_inverse_scale: torch.Tensor, out_inverse_scale: torch.Tensor,
                    fast_accum: bool = True) -> torch.Tensor:
    """e4m3 tanh-GELU(x @ W^T + b) at the next layer's static input scale (`out_inverse_scale` = 1 / that scale): an
    MLP's first fp8 GEMM, its activation and the second GEMM's input cast as one cuBLASLt kernel (`overdrive::
    fp8_gemm_gelu`). x's own cast stays plain torch ops, so under torch.compile it fuses into x's producer."""
    xq = _eager_fused(triton_kernels.quantize_tensor_fp8_static, quantize_tensor_fp8_static, x2d, x_inverse_scale)
    return torch.ops.overdrive.fp8_gemm_gelu(xq, x_scale, w_fp8, w_scale, None if bias is None else bias.to(x2d.dtype),
                                             out_inverse_scale, fast_accum)


_cublaslt_state = {"ok": True}


@torch.library.custom_op("overdrive::fp8_gemm_gelu", mutates_args=())
def _fp8_gemm_gelu(xq: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_inverse_scale: torch.Tensor, fast_accum: bool) -> torch.Tensor:
    """cuBLASLt's fp8 GEMM with its GELU epilogue on CUDA; elsewhere, or if cuBLASLt fails, the same function as torch
    ops (the fp8 GEMM writing 16 bits, tanh-GELU in float32, the cast)."""
    if xq.is_cuda and _cublaslt_state["ok"]:
        try:
            from . import cublaslt
            return cublaslt.fp8_gemm_gelu(xq, x_scale, w_fp8, w_scale, bias, out_inverse_scale, fast_accum)
        except Exception as error:  # noqa: BLE001 - a missing or refusing cuBLASLt costs speed, never the run
            _cublaslt_state["ok"] = False
            log.warning("Overdrive quantization: cuBLASLt's fp8 GEMM + GELU kernel unavailable (%s); the MLPs run it "
                        "as separate kernels.", error)
    y = fp8_gemm(xq, x_scale, w_fp8, w_scale, bias, torch.bfloat16 if bias is None else bias.dtype, fast_accum)
    return quantize_tensor_fp8_static(F.gelu(y.float(), approximate="tanh"), out_inverse_scale)


def fp8_gemm_gelu_runs_as(device) -> str:
    """What runs a fused MLP's first layer on `device`, in words for the log."""
    device = torch.device(device)
    why = "the fused cuBLASLt kernel needs an NVIDIA GPU"
    if device.type == "cuda":
        why = "cuBLASLt's fused kernel is unavailable here"
        if _cublaslt_state["ok"]:
            try:
                from . import cublaslt
                cublaslt._library()
                return "as one cuBLASLt kernel (fp8 GEMM with a tanh-GELU epilogue writing fc2's e4m3 input)"
            except Exception:  # noqa: BLE001 - the message below says what runs instead
                pass
    return f"as separate torch ops on {device.type} (fp8 GEMM, tanh-GELU, cast to fc2's e4m3 input): {why}"


@_fp8_gemm_gelu.register_fake
def _(xq, x_scale, w_fp8, w_scale, bias, out_inverse_scale, fast_accum):
    return xq.new_empty((xq.shape[0], w_fp8.shape[0]), dtype=FP8_DTYPE)


# A compiled call with at most this many rows runs a weight-only layer as one fused reduction that reads the int8
# weight once (a matrix-vector product is bound by reading the weight); more rows make it a GEMM again. On CUDA the
# Triton kernel below does it instead, for up to triton_kernels.WEIGHT_ONLY_MAX_ROWS rows.
WEIGHT_ONLY_REDUCTION_ROWS = 8


def weight_only_linear(x2d: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """y = x @ (W_int8 * scale)^T + b, computed in float. x2d: (M, K); w_int8: (N, K); w_scale: (1, N) float32.

    With up to WEIGHT_ONLY_MAX_ROWS 16-bit rows on CUDA, compiled or not: one Triton kernel that streams the int8
    weight once (the custom op `overdrive::weight_only_matmul`). Elsewhere under torch.compile with few rows: products
    summed in float32 as one Inductor reduction, output channels outermost so a weight row is read once for all of x's
    rows. Otherwise (eager, or many rows): the weight is dequantized to x's dtype and multiplied by the float GEMM
    (one more pass over the weight than the float layer)."""
    rows = x2d.shape[0]
    if (x2d.is_cuda and _triton_state["ok"] and x2d.dtype in (torch.float16, torch.bfloat16)
            and rows <= triton_kernels.WEIGHT_ONLY_MAX_ROWS):
        return torch.ops.overdrive.weight_only_matmul(x2d, w_int8, w_scale, bias, out_dtype)
    if torch.compiler.is_compiling() and rows <= WEIGHT_ONLY_REDUCTION_ROWS:
        products = x2d.float().unsqueeze(0) * w_int8.float().unsqueeze(1)  # (N, M, K), fused, never stored
        y = products.sum(-1).t() * w_scale
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
    return _dequantized_linear(x2d, w_int8, w_scale, bias, out_dtype)


def _dequantized_linear(x2d, w_int8, w_scale, bias, out_dtype):
    weight = w_int8.to(x2d.dtype) * w_scale.t().to(x2d.dtype)
    return F.linear(x2d, weight, None if bias is None else bias.to(x2d.dtype)).to(out_dtype)


@torch.library.custom_op("overdrive::weight_only_matmul", mutates_args=())
def _weight_only_matmul(x2d: torch.Tensor, w_int8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel as one opaque op for torch.compile and CUDA graphs; the dequantizing path if it fails."""
    if _triton_state["ok"]:
        try:
            return triton_kernels.weight_only_matmul(x2d, w_int8, w_scale, bias, out_dtype)
        except Exception as error:  # noqa: BLE001 - a Triton build problem costs speed, never the run
            _triton_failed(error)
    return _dequantized_linear(x2d, w_int8, w_scale, bias, out_dtype)


@_weight_only_matmul.register_fake
def _(x2d, w_int8, w_scale, bias, out_dtype):
    return x2d.new_empty((x2d.shape[0], w_int8.shape[0]), dtype=out_dtype)


# ----------------------------------------------------------------------------------------------- references
def reference_int8_linear(x2d, w_int8, w_scale, bias, out_dtype):
    """Dequantize-then-matmul oracle for `int8_linear` (tests, CPU). Exact integer products in float64."""
    xq, x_scale = quantize_rows_int8(x2d)
    acc = xq.double() @ w_int8.double().t()
    y = acc.float() * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def reference_fp8_linear(x2d, w_fp8, w_scale, bias, out_dtype, x_scale=None):
    """Dequantize-then-matmul oracle for `fp8_linear` (tests, CPU)."""
    if x_scale is None:
        xq, x_scale = quantize_tensor_fp8(x2d)
    else:
        xq = quantize_tensor_fp8_static(x2d, 1.0 / x_scale)
    y = (xq.double() @ w_fp8.double().t()) * (x_scale.double() * w_scale.double())
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)


def reference_weight_only_linear(x2d, w_int8, w_scale, bias, out_dtype):
    """Dequantize-then-matmul oracle for `weight_only_linear` (tests, CPU), in float64."""
    y = (x2d.double() @ w_int8.double().t()) * w_scale.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype)

"""int4 weights, fp8 compute: 4-bit integers with a scale per group of 128 input channels (half the bytes of an 8-bit
layer: what lets a Flux-class model fit a small card whole, or stream half as much), turned into an e4m3 weight by one
elementwise pass right before the fp8 GEMM (`kernels.dequantize_int4_fp8`), activations as in the fp8 format (a static
per-tensor scale from calibration). The GEMM is fp8's `torch._scaled_mm`, so it runs where fp8 does (compute capability
8.9+); the CPU runs the same arithmetic for tests. The pass costs one write and read of the e4m3 weight per call: under
a 4-bit choice the calibration does not time layers against float (4 bits are chosen for memory), and a layer whose
4-bit error is above its threshold takes the 8-bit path instead (calibrate.py)."""
from __future__ import annotations

import torch

from .. import kernels
from .fp8 import Fp8E4m3, Fp8Linear
from .base import QuantFormat, register


class Int4Linear(Fp8Linear):
    """Linear with int4 weights (two a byte) and float16 group-scale ratios, run as an fp8 linear on the e4m3 weight
    they make. Never fused with a GELU (gelu_fusion takes exact Fp8Linear pairs)."""

    format = "int4_fp8"
    storage_dtype = torch.uint8
    quantized_names = ("weight_q", "weight_scale", "group_scale")
    group = kernels.INT4_GROUP

    def __init__(self, in_features, out_features, bias=True, device=None, fast_accum: bool = True):
        if int(in_features) % self.group:
            raise ValueError(f"Int4Linear: in_features={in_features} is not a multiple of its group of {self.group} "
                             f"input channels; keep this layer in 8 bits.")
        super().__init__(in_features, out_features, bias=bias, device=device, fast_accum=fast_accum)
        self.register_buffer("group_scale", torch.ones(self.out_features, self.in_features // self.group,
                                                       dtype=torch.float16, device=device))

    def storage_shape(self) -> tuple:
        return (self.out_features, self.in_features // 2)

    def quantize_weight(self, weight):
        return kernels.quantize_weight_int4(weight, self.group)

    def fp8_weight(self) -> torch.Tensor:
        return kernels.int4_fp8_weight(self.weight_q, self.group_scale)

    def gemm(self, x2d, out_dtype):
        return kernels.fp8_linear(x2d, self.fp8_weight(), self.weight_scale, self.bias, out_dtype, self.fast_accum,
                                  self.input_scale, self.input_scale_inverse)

    def gemm_quantized(self, xq, out_dtype):
        return kernels.fp8_gemm(xq, self.input_scale, self.fp8_weight(), self.weight_scale, self.bias, out_dtype,
                                self.fast_accum)

    def reference_gemm(self, x2d, out_dtype):
        return kernels.reference_fp8_linear(x2d, kernels.dequantize_int4_fp8(self.weight_q, self.group_scale),
                                            self.weight_scale, self.bias, out_dtype, self.input_scale)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", int4 weights in groups of {self.group}"


class Int4Fp8(Fp8E4m3):
    """fp8's options, finishing and timing; K in whole groups."""

    def __init__(self):
        QuantFormat.__init__(self, "int4_fp8", Int4Linear, kernel="torch._scaled_mm on int4 weights made e4m3",
                             k_multiple=16, bits=4, probe=self._run_scaled_mm, min_capability=(8, 9), auto_priority=1,
                             hardware="an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)")

    def shape_problem(self, k: int, n: int) -> str | None:
        if k % kernels.INT4_GROUP:
            return f"K={k} not a multiple of {kernels.INT4_GROUP} (int4 scale groups)"
        return super().shape_problem(k, n)


register(Int4Fp8())

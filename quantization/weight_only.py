"""Weight-only int8 storage for memory-bound layers: the weight kept in 8 bits (one scale per output channel), the
product computed in the model's own precision.

A layer below the compute-density threshold (Flux's and Qwen-Image's modulation linears: one row of input per call,
a third of Flux's parameters) gains nothing from an 8-bit GEMM's arithmetic: its time is reading the weight (with
tens of rows the GEMM can still be faster; calibration times both there, calibrate._gemm_if_faster). Stored in int8 it
takes half the memory and, under torch.compile, half the bytes to read: a call with a few rows runs as one fused
reduction over the int8 weight (`kernels.weight_only_linear`). int8 with a scale per output channel keeps ~10x less
error than fp8 e4m3 with one per tensor, at the same size, and needs no special kernel, so every format uses it.
"""
from __future__ import annotations

from . import kernels
from .formats.int8 import Int8Linear

FORMAT = "int8_weight_only"


class Int8WeightOnlyLinear(Int8Linear):
    """int8's storage (an int8 weight, a float32 scale per output channel) with float inputs, outputs and bias: the
    product runs in the model's precision instead of an int8 GEMM."""

    format = FORMAT

    def gemm(self, x2d, out_dtype):
        return kernels.weight_only_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype)

    def reference_gemm(self, x2d, out_dtype):
        return kernels.reference_weight_only_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weight-only int8"

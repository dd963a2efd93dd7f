"""int8 W8A8: int8 per-output-channel weights, per-token dynamic int8 activations, `torch._int_mm` (NVIDIA compute
capability 8.0+, and the CPU)."""
from __future__ import annotations

import torch

from .. import kernels
from ..gemm import QuantizedGemm
from .base import QuantFormat, register


class Int8Linear(QuantizedGemm):
    """W8A8 linear: int8 per-output-channel weights, per-token dynamic int8 activations, `torch._int_mm`."""

    format = "int8"
    storage_dtype = torch.int8

    def quantize_weight(self, weight):
        return kernels.quantize_weight_int8(weight)

    def gemm(self, x2d, out_dtype):
        return kernels.int8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype)

    def reference_gemm(self, x2d, out_dtype):
        return kernels.reference_int8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype)


def _run_int_mm(device):
    a = torch.zeros(32, 32, dtype=torch.int8, device=device)
    torch._int_mm(a, a.t())


register(QuantFormat("int8", Int8Linear, kernel="torch._int_mm", k_multiple=8, probe=_run_int_mm,
                     min_capability=(8, 0), auto_priority=1, auto_on_cpu=True,
                     hardware="an NVIDIA GPU of compute capability 8.0 or newer, or the CPU"))

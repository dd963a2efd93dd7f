"""Activations rewritten, inside compiled code only, into forms Inductor compiles fast.

DiT MLPs (Flux, Wan, Qwen-Image, SD3, LTX) use tanh-GELU. Inductor lowers `tanh` to libdevice's, a long instruction
sequence, which makes the fused kernel between two fp8 GEMMs (GELU, then the cast to e4m3) compute-bound. The same
function through a sigmoid, 0.5 (1 + tanh z) = sigmoid(2 z), lowers to one exponential and a division: Flux's single
block kernel ran faster with the multiply-by-inverse-scale cast, within an ulp of float32, the e4m3 output identical
but for a handful of values (bench/probes/gelu_epilogue.py, `2026-11-26_h100_gelu_epilogue.json`). Eager
code keeps torch's own GELU (one kernel, where the sigmoid form would be six).
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2 * sqrt(2 / pi)


def tanh_gelu_via_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """F.gelu(x, approximate="tanh"), computed in float32 and returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.sigmoid(TWO_SQRT_2_OVER_PI * (x32 + 0.044715 * x32 * x32 * x32))).to(x.dtype)


class FastActivations(TorchFunctionMode):
    """Entered inside the function torch.compile traces (compiler/shared_graph.py): tanh-GELU calls, functional or
    through nn.GELU, become `tanh_gelu_via_sigmoid` in the graph; every other call is traced as written."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.gelu and kwargs.get("approximate", args[1] if len(args) > 1 else "none") == "tanh":
            return tanh_gelu_via_sigmoid(args[0] if args else kwargs["input"])
        return func(*args, **kwargs)

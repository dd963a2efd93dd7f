"""Which modules are linear layers (x @ W.T + b), and their weights in float. nn.Linear, and other libraries' layers
registered by their host: ComfyUI's mixed-precision ops (comfy_host/checkpoint_formats.py), whose weight may be a tensor
subclass holding a checkpoint's stored low-bit data (comfy-kitchen's QuantizedTensor), which `float_weight`
dequantizes."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

_LINEAR_LAYERS: list = []  # predicates on a module, registered by hosts


def register_linear_layer(is_linear: Callable[[nn.Module], bool]) -> None:
    if is_linear not in _LINEAR_LAYERS:
        _LINEAR_LAYERS.append(is_linear)


def is_linear_layer(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or any(is_linear(module) for is_linear in _LINEAR_LAYERS)


def stored_low_bit(tensor: torch.Tensor) -> bool:
    """A weight kept in a checkpoint's low-bit format: a tensor subclass that dequantizes itself."""
    return type(tensor) not in (torch.Tensor, nn.Parameter) and callable(getattr(tensor, "dequantize", None))


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def plain_fp8(tensor: torch.Tensor) -> bool:
    """A weight a checkpoint stores cast to fp8 without a scale (the first fp8 files), which ComfyUI keeps so on the
    GPU and casts per call."""
    return type(tensor) in (torch.Tensor, nn.Parameter) and tensor.dtype in FP8_DTYPES


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    if stored_low_bit(tensor):
        return tensor.dequantize()
    return tensor.to(torch.bfloat16) if plain_fp8(tensor) else tensor  # few torch ops take fp8 operands


def stored_in_float(tensor: torch.Tensor) -> bool:
    """A weight `float_weight` returns as it is (not a low-bit one it makes a float copy of)."""
    return not stored_low_bit(tensor) and not plain_fp8(tensor)


def float_weight(module: nn.Module) -> torch.Tensor:
    """`module`'s weight in float: dequantized where the checkpoint stores it in a low-bit format."""
    return dequantized(module.weight)


def baseline(module: nn.Module) -> str:
    """What a layer's measured speed is relative to, in the report's words."""
    return "its stored low-bit layer" if stored_low_bit(module.weight) else "the float layer"

"""Which modules are linear layers (x @ W.T + b), and their weights in float. nn.Linear, and other libraries' layers
registered by their host: ComfyUI's mixed-precision ops (nodes/checkpoint_formats.py), whose weight may be a tensor
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


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.dequantize() if stored_low_bit(tensor) else tensor


def float_weight(module: nn.Module) -> torch.Tensor:
    """`module`'s weight in float: dequantized where the checkpoint stores it in a low-bit format."""
    return dequantized(module.weight)


def baseline(module: nn.Module) -> str:
    """What a layer's measured speed is relative to, in the report's words."""
    return "its stored low-bit layer" if stored_low_bit(module.weight) else "the float layer"

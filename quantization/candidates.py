"""Which layers of a model are candidates, and which of them a low-precision kernel can run at all."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch.nn as nn

from . import formats
from .config import QuantConfig
from .linear_layers import is_linear_layer

# torchao style: filter_fn(module, qualified_name) -> keep? A string instead of False leaves the layer alone and is the
# report's reason for it (a family's layers that must stay float say why).
FilterFn = Callable[[nn.Module, str], "bool | str"]


def keeping_float(float_layers: dict, filter_fn: FilterFn | None = None) -> FilterFn | None:
    """`filter_fn`, with the layers whose qualified names `float_layers`' patterns match from their start ({pattern:
    why}, a family's) left alone and their reason reported."""
    if not float_layers:
        return filter_fn
    patterns = [(re.compile(pattern), why) for pattern, why in float_layers.items()]

    def keep(module, name):
        why = next((why for pattern, why in patterns if pattern.match(name)), None)
        return why if why is not None else (filter_fn is None or filter_fn(module, name))
    return keep


@dataclasses.dataclass
class Candidate:
    name: str
    module: nn.Module
    kind: str                   # "linear", "conv1x1", "conv3x3", ...
    skip_reason: str | None     # set when the layer is left alone before any measurement
    record_inputs: bool         # collect input rows (measurable) or only the input shape (for the report)

    @property
    def in_features(self) -> int:
        return math.prod(self.module.weight.shape[1:])

    @property
    def out_features(self) -> int:
        return self.module.weight.shape[0]


def layer_kind(module: nn.Module) -> str | None:
    if is_linear_layer(module):
        return "linear"
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return f"conv{kh}x{kw}"
    return None


def _conv_problem(conv: nn.Conv2d) -> str | None:
    kh, kw = conv.kernel_size
    if (kh, kw) != (1, 1):
        return f"no low-precision kernel for {kh}x{kw} conv (left in the model's dtype)"
    odd = []
    if tuple(conv.stride) != (1, 1):
        odd.append(f"stride {tuple(conv.stride)}")
    if not isinstance(conv.padding, str) and tuple(conv.padding) != (0, 0):  # "same"/"valid" are no padding at 1x1
        odd.append(f"padding {conv.padding}")
    if tuple(conv.dilation) != (1, 1):
        odd.append(f"dilation {tuple(conv.dilation)}")
    if conv.groups != 1:
        odd.append(f"groups={conv.groups}")
    if odd:
        return f"no low-precision kernel for 1x1 conv with {', '.join(odd)}"
    return None


def find_candidates(model: nn.Module, config: QuantConfig, fmt: str | None,
                    filter_fn: FilterFn | None = None) -> list:
    """Every nn.Linear / nn.Conv2d of `model`, each with the reason it is left alone (None: measure it).

    `fmt` None skips the format-specific shape checks (they run again at decision time).
    """
    found = []
    for name, module in model.named_modules():
        kind = layer_kind(module)
        if kind is None or getattr(module, "weight", None) is None:
            continue
        reason = None
        record = False
        verdict = True if filter_fn is None else filter_fn(module, name)
        if isinstance(verdict, str) or not verdict:
            reason = verdict if isinstance(verdict, str) and verdict else "excluded by filter_fn"
        elif kind == "linear" and not config.quantize_linear:
            reason = "linear quantization off (quantize_linear=False)"
        elif kind != "linear" and not config.quantize_conv:
            reason = "conv quantization off (quantize_conv=False)"
        elif kind != "linear" and _conv_problem(module):
            reason = _conv_problem(module)
            record = True  # input shape only: the report still shows the layer's density
        elif not module.weight.is_floating_point():
            reason = f"weight dtype {module.weight.dtype} is not a float type"
        elif fmt is not None:
            shape = module.weight.shape
            reason = formats.get(fmt).shape_problem(math.prod(shape[1:]), shape[0])
        found.append(Candidate(name, module, kind, reason, record_inputs=reason is None or record))
    return found

"""Drop-in quantized replacements for nn.Linear and 1x1 nn.Conv2d in any registered format (quantization/formats/:
int8 `Int8Linear`, fp8 `Fp8Linear`). `QuantConv2d1x1` runs a 1x1 / stride 1 / ungrouped conv as a GEMM over pixels
(NCHW -> rows of channels) through a format's linear layer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import formats
from .formats.fp8 import Fp8Linear
from .formats.int8 import Int8Linear
from .gemm import QuantizedGemm
from .linear_layers import float_weight, is_linear_layer
from .weight_only import Int8WeightOnlyLinear
from ..core.weights_ahead import on_device_ahead

__all__ = ["QuantConv2d1x1", "QuantizedGemm", "Int8Linear", "Fp8Linear", "quantized_module_for", "replacement_for",
           "weight_only_module_for", "build_empty",
           "gemm_of", "quantized_layers", "float_reference", "requantize"]


class QuantConv2d1x1(nn.Module):
    """A 1x1 conv (stride 1, no padding, one group) as a GEMM over pixels through a quantized linear `gemm`.

    The output has the input's memory format (NCHW-contiguous in, NCHW-contiguous out; channels-last in,
    channels-last out), as nn.Conv2d would.
    """

    def __init__(self, gemm: QuantizedGemm):
        super().__init__()
        self.gemm = gemm
        self.in_channels = gemm.in_features
        self.out_channels = gemm.out_features

    @classmethod
    def from_float(cls, conv: nn.Conv2d, fmt: str, **kwargs):
        return cls(formats.get(fmt).layer.from_float(conv.weight, conv.bias, **kwargs))

    @property
    def format(self) -> str:
        return self.gemm.format

    def load_float_weight(self, weight, bias=None, quantize_on=None):
        self.gemm.load_float_weight(weight, bias, quantize_on)
        return self

    def quantized_state(self) -> dict:
        return self.gemm.quantized_state()

    def load_quantized_state(self, state: dict):
        self.gemm.load_quantized_state(state)
        return self

    def set_input_amax(self, amax):
        self.gemm.set_input_amax(amax)
        return self

    def _run(self, x, gemm_fn):
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(0)
        b, c, h, w = x.shape
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        y = gemm_fn(rows, x.dtype).reshape(b, h, w, self.out_channels).permute(0, 3, 1, 2)
        y = y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return y.squeeze(0) if unbatched else y

    def forward(self, x):
        return self._run(x, self.gemm.gemm)

    def reference_forward(self, x):
        return self._run(x, self.gemm.reference_gemm)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size=(1, 1), format={self.format}"


def gemm_of(layer: nn.Module) -> QuantizedGemm:
    """The quantized linear that runs `layer` (a 1x1 conv's inner GEMM, or the layer itself)."""
    return layer.gemm if isinstance(layer, QuantConv2d1x1) else layer


def replacement_for(module: nn.Module, build, device=None, on_device: tuple | None = None) -> nn.Module:
    """An nn.Linear or 1x1 nn.Conv2d replaced by the quantized linear `build(weight, bias)` makes from its weights
    (moved to `device` first, default: where they are; `on_device`: its (float weight, bias) already copied there, by
    `float_tensors` and `core.weights_ahead`); a conv gets its GEMM wrapper."""
    weight, bias = on_device or float_tensors(module)
    if device is not None and on_device is None:
        weight = weight.to(device)
        bias = None if bias is None else bias.to(device)
    gemm = build(weight, bias)
    if is_linear_layer(module):
        return gemm
    if isinstance(module, nn.Conv2d):
        return QuantConv2d1x1(gemm)
    raise TypeError(f"no quantized replacement for {type(module).__name__}")


def float_tensors(module: nn.Module) -> tuple:
    """(float weight, bias) of an nn.Linear or 1x1 nn.Conv2d, where they are."""
    return float_weight(module), module.bias


def quantized_module_for(module: nn.Module, fmt: str, config, device=None,
                         input_amax: torch.Tensor | None = None, on_device: tuple | None = None) -> nn.Module:
    """The quantized replacement of an nn.Linear or 1x1 nn.Conv2d in format `fmt` with `config`'s (a QuantConfig)
    format options, on `device` (default: the weight's device), finished with the calibration's `input_amax` (the
    inputs' largest magnitude) where the format uses it."""
    plugin = formats.get(fmt)

    def build(weight, bias):
        return plugin.calibrated(plugin.layer.from_float(weight, bias, **plugin.layer_options(config)), input_amax,
                                 config)
    return replacement_for(module, build, device, on_device)


def weight_only_module_for(module: nn.Module, device=None, on_device: tuple | None = None) -> nn.Module:
    """The weight-only int8 replacement of an nn.Linear or 1x1 nn.Conv2d (quantization/weight_only.py)."""
    return replacement_for(module, Int8WeightOnlyLinear.from_float, device, on_device)


def build_empty(kind: str, fmt: str, in_features: int, out_features: int, bias: bool, config,
                device=None) -> nn.Module:
    """An unfilled quantized module of the given kind, to receive cached quantized tensors."""
    plugin = formats.get(fmt)
    gemm = plugin.layer(in_features, out_features, bias=bias, device=device, **plugin.layer_options(config))
    return gemm if kind == "linear" else QuantConv2d1x1(gemm)


def quantized_layers(module: nn.Module) -> dict:
    """{name: quantized layer} in `module`'s tree (a 1x1 conv's wrapper, not its inner GEMM)."""
    layers = {name: sub for name, sub in module.named_modules() if isinstance(sub, QuantConv2d1x1)}
    inner = {f"{name}.gemm" for name in layers}
    layers.update({name: sub for name, sub in module.named_modules()
                   if isinstance(sub, QuantizedGemm) and name not in inner})
    return layers


def float_reference(module: nn.Module, layers: dict) -> dict:
    """name -> tensor of the float checkpoint `module` stands for, where `layers` (name -> quantized layer) replace
    float ones: those as meta tensors of the float weight's shape (they are quantized again, not copied)."""
    reference = {k: v for k, v in module.state_dict(keep_vars=True).items()
                 if not any(k.startswith(f"{name}.") for name in layers)}
    for name, layer in layers.items():
        gemm = gemm_of(layer)
        shape = (gemm.out_features, gemm.in_features) + ((1, 1) if isinstance(layer, QuantConv2d1x1) else ())
        reference[f"{name}.weight"] = torch.empty(shape, device="meta")
        if gemm.bias is not None:
            reference[f"{name}.bias"] = torch.empty(gemm.out_features, device="meta")
    return reference


def requantize(layers: dict, state: dict, copy: bool, quantize_on=None) -> dict:
    """Weight switching: `layers` (name -> quantized layer) quantized again from a checkpoint's float `state` (name ->
    tensor, checkpoint key names), keeping each layer's format, scales rule and static input scale (the decisions
    stand). `copy`: new layers, so a model still running keeps its own (ComfyUI); else in place (a pipeline's).
    `quantize_on`: the device that quantizes (default: each layer's own)."""
    import copy as copying
    fresh, names = {}, list(layers)
    tensors = [(state[f"{name}.weight"], state.get(f"{name}.bias")) for name in names]
    # to the quantizing card one layer ahead; where each layer quantizes on its own device, as they are
    arriving = on_device_ahead(tensors, quantize_on) if quantize_on is not None else (pair for pair in tensors)
    try:
        for index, name in enumerate(names):
            target = copying.deepcopy(layers[name]) if copy else layers[name]
            try:
                fresh[name] = target.load_float_weight(*next(arriving), quantize_on)
            except torch.OutOfMemoryError:  # the card full beside a loaded model: this layer quantized where it
                arriving.close()  # is, the rest copied to the card one at a time (each falls back the same way)
                arriving = (pair for pair in tensors[index + 1:])
                torch.cuda.empty_cache()
                fresh[name] = target.load_float_weight(*tensors[index])
    finally:
        arriving.close()  # the copies ahead: their page-locked buffers go now
    return fresh

"""Layers a checkpoint already stores in 8 or 4 bits: ComfyUI's mixed-precision layers holding comfy-kitchen
QuantizedTensors (fp8 scaled and mixed, nvfp4, int8 convrot, mxfp8 files), run by ComfyUI's own kernels. Quantize Model
reports them (one line per run, the layers at debug level) rather than passing such a model through without a word."""
import collections
import logging

import torch

log = logging.getLogger("overdrive")


def stored_formats(module: torch.nn.Module) -> dict:
    """{layer name: its stored format} for every layer of `module` whose weight is a QuantizedTensor."""
    from comfy.quant_ops import QuantizedTensor

    found = {}
    for name, layer in module.named_modules():
        weight = layer._parameters.get("weight")
        if isinstance(weight, QuantizedTensor):
            found[name] = getattr(layer, "quant_format", None) or type(weight).__name__
    return found


def mixed_precision_float_layers(module: torch.nn.Module, stored: dict) -> list:
    """The float layers of ComfyUI's mixed-precision ops (not nn.Linear: Overdrive's quantizer does not take them)."""
    return [name for name, layer in module.named_modules()
            if name not in stored and type(layer).__qualname__.startswith("mixed_precision_ops.")
            and layer._parameters.get("weight") is not None]


def describe(stored: dict) -> str:
    counts = collections.Counter(stored.values())
    return ", ".join(f"{count} in {fmt}" for fmt, count in sorted(counts.items()))


def report(module: torch.nn.Module) -> tuple:
    """(layers stored quantized, float layers of ComfyUI's mixed-precision ops), logged: one line, and each layer at
    debug level."""
    stored = stored_formats(module)
    others = mixed_precision_float_layers(module, stored)
    if stored or others:
        log.info("Overdrive quantization: this checkpoint stores %d layer(s) quantized (%s), kept as they are and run "
                 "by ComfyUI's own kernels; its %d other layer(s) are ComfyUI's mixed-precision layers, which "
                 "Overdrive's quantizer does not convert.", len(stored), describe(stored) or "none", len(others))
        for name, fmt in stored.items():
            log.debug("Overdrive quantization: %s stored in %s (kept)", name, fmt)
        for name in others:
            log.debug("Overdrive quantization: %s is a mixed-precision float layer (kept)", name)
    return stored, others

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


def _is_mixed_precision_layer(layer: torch.nn.Module) -> bool:
    """A layer of ComfyUI's mixed-precision ops (comfy.ops.mixed_precision_ops, a class made per model)."""
    return type(layer).__qualname__.startswith("mixed_precision_ops.")


def mixed_precision_float_layers(module: torch.nn.Module, stored: dict) -> list:
    """The float layers of ComfyUI's mixed-precision ops (not nn.Linear: Overdrive's quantizer does not take them)."""
    return [name for name, layer in module.named_modules()
            if name not in stored and _is_mixed_precision_layer(layer) and layer._parameters.get("weight") is not None]


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


def is_mixed_precision(module: torch.nn.Module) -> bool:
    """Whether `module` holds ComfyUI's mixed-precision layers (a checkpoint stored quantized, in whole or in part)."""
    return any(_is_mixed_precision_layer(layer) for layer in module.modules())


def converted_state(path, reference: dict) -> dict:
    """A diffusion-model file's tensors as ComfyUI's loader converts them for a quantized model (an fp8 "scaled" file's
    scales renamed, each quantized layer's format record added: comfy.utils.convert_old_quants), under the key prefix
    that holds `reference` (the running model's state dict)."""
    import comfy.utils

    from ..compiler.switch_weights import module_keys, unreadable
    try:
        state, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    except Exception as error:  # noqa: BLE001 - the loader's errors name neither the file nor the consequence
        raise unreadable(path, error) from error
    names = module_keys(list(state), reference, path)
    prefix = next(iter(names.values()))[: -len(next(iter(names)))] if names else ""
    state, _ = comfy.utils.convert_old_quants(state, prefix, metadata)
    state = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    return {key: _as_running(value, reference.get(key)) for key, value in state.items()}


def _as_running(value: torch.Tensor, running: torch.Tensor | None) -> torch.Tensor:
    """A float tensor in the running model's float dtype (a switch never changes precision, and dtype guards never
    recompile); stored 8-bit data and format records as they are."""
    if running is None or not (value.is_floating_point() and running.is_floating_point()):
        return value
    return value if min(value.element_size(), running.element_size()) == 1 else value.to(running.dtype)


def twin_loaded_by_its_layers(module: torch.nn.Module, state: dict, loader_state: tuple = ()) -> torch.nn.Module:
    """A copy of `module` holding `state`, loaded through its layers' own state-dict loading, where ComfyUI's
    mixed-precision layers build their quantized weights from a file's tensors. The copy shares no tensor with
    `module` and is made without copying its weights (each stands in as an empty meta tensor until loaded)."""
    from ..compiler.switch_weights import structural_copy

    def placeholder(tensor):
        empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        return torch.nn.Parameter(empty, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else empty

    placeholders = {id(tensor): placeholder(tensor) for layer in module.modules()
                    for tensors in (layer._parameters, layer._buffers) for tensor in tensors.values()
                    if tensor is not None}
    twin = structural_copy(module, placeholders, loader_state)
    twin.load_state_dict(state, strict=True, assign=True)
    return twin

"""Layers a checkpoint already stores in 8 or 4 bits: ComfyUI's mixed-precision layers holding comfy-kitchen
QuantizedTensors (fp8 scaled and mixed, nvfp4, int8 convrot, mxfp8 files), run by ComfyUI's own kernels, and weights
stored in fp8 without a scale (cast per call). Quantize Model takes them as candidates like any linear layer
(registered here), measured from their dequantized weights against the stored layer itself: converted where
Overdrive's kernel is faster, kept where ComfyUI's is as fast; one line per run says which, and each layer is at
debug level."""
import collections
import logging

import torch

from ..quantization.linear_layers import plain_fp8, register_linear_layer, stored_low_bit
from .quantized_state import quantized_modules

log = logging.getLogger("overdrive")


def stored_formats(module: torch.nn.Module, unscaled: bool = True) -> dict:
    """{layer name: its stored format} for every layer of `module` whose weight is a QuantizedTensor, and (`unscaled`)
    every one whose weight is plain fp8."""
    found = {}
    for name, layer in module.named_modules():
        weight = layer._parameters.get("weight")
        if weight is not None and stored_low_bit(weight):
            found[name] = getattr(layer, "quant_format", None) or type(weight).__name__
        elif weight is not None and unscaled and plain_fp8(weight):
            found[name] = f"{str(weight.dtype).removeprefix('torch.')} unscaled"
    return found


def _is_mixed_precision_layer(layer: torch.nn.Module) -> bool:
    """A layer of ComfyUI's mixed-precision ops (comfy.ops.mixed_precision_ops, a class made per model)."""
    return type(layer).__qualname__.startswith("mixed_precision_ops.")


def _is_mixed_precision_linear(layer: torch.nn.Module) -> bool:
    return _is_mixed_precision_layer(layer) and type(layer).__name__ == "Linear"


register_linear_layer(_is_mixed_precision_linear)


def describe(stored: dict) -> str:
    counts = collections.Counter(stored.values())
    return ", ".join(f"{count} in {fmt}" for fmt, count in sorted(counts.items()))


def report(module: torch.nn.Module) -> dict:
    """{layer: stored format} of the layers `module` holds quantized as its checkpoint stores them, logged."""
    stored = stored_formats(module)
    if stored:
        log.info("Overdrive quantization: this checkpoint stores %d layer(s) quantized (%s); each is measured "
                 "against Overdrive's kernels from its dequantized weights, converted where those are faster and "
                 "kept for ComfyUI's own kernels where not.", len(stored), describe(stored))
    return stored


def report_conversions(stored: dict, converted: dict) -> None:
    """One line: how many of the layers stored quantized (`stored`: {layer: format}) Quantize Model replaced by its
    own (`converted`: {layer: its new format}) and how many it kept; each layer at debug level."""
    if not stored:
        return
    taken = {name: fmt for name, fmt in stored.items() if name in converted}
    kept = {name: fmt for name, fmt in stored.items() if name not in converted}
    log.info("Overdrive quantization: of the %d layer(s) this checkpoint stores quantized, %d now run Overdrive's "
             "kernels (%s) and %d keep ComfyUI's (%s).", len(stored), len(taken),
             describe({name: converted[name] for name in taken}) or "none", len(kept), describe(kept) or "none")
    for name, fmt in stored.items():
        log.debug("Overdrive quantization: %s stored in %s: %s", name, fmt,
                  f"converted to {converted[name]}" if name in taken else "kept")


def advise_before_compile(patcher) -> None:
    """Compile Model on layers the checkpoint stores quantized that Quantize Model did not convert: on an NVIDIA GPU
    their input quantization (comfy-kitchen's QuantizedTensor) did not compile (on an H200 their blocks fell back to
    eager), so the log says what to do."""

    if torch.device(patcher.load_device).type != "cuda":
        return
    # Plain fp8 weights are left out: ComfyUI casts those per call, which compiles.
    left = set(stored_formats(patcher.model.diffusion_model, unscaled=False)) - set(quantized_modules(patcher))
    if left:
        log.warning("Overdrive Compile Model: %d layer(s) of this checkpoint stay stored quantized on ComfyUI's own "
                    "layers, whose input quantization may not compile (the blocks holding them then run eager). Put "
                    "Quantize Model before Compile Model: it runs them as Overdrive's 8-bit layers where faster.",
                    len(left))


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

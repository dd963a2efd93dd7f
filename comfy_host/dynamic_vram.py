"""Compile Model under ComfyUI's dynamic VRAM (ModelPatcherDynamic with comfy-aimdo, ComfyUI's default on NVIDIA GPUs).

Dynamic VRAM keeps every weight of a model in host memory and has each layer fetch its weights onto the GPU inside
its own call. A compiled block then traces ComfyUI's fetching code instead of a plain GEMM, and its weights are host
tensors, so it can be replayed as no CUDA graph: compiled Flux ran slower than eager that way. Where the model fits the
GPU whole, Compile Model therefore takes ComfyUI's classic loader for its clone, as ComfyUI's own TorchCompileModel does,
over a copy of the model that shares its tensors (model_copies.classic_clone: ComfyUI's own way reloads the file into
host memory at every run), and logs it. So does
a quantized model whose quantized layers do not all fit: Overdrive streams those itself. Any other model that does not
fit keeps dynamic VRAM and its blocks run as ComfyUI runs them (never slower than eager); the log says so.
"""
import logging

import torch

from .gpu_budget import gpu_budget_bytes
from .model_copies import classic_clone
from .quantized_state import quantized_modules, resident_bytes
from .layer_tensors import tensor_bytes

log = logging.getLogger("overdrive")

# Room beside the weights for activations, compiled code's workspace and the CUDA graphs' pools, as a fraction of the
# weights (at least WORKSPACE_MIN_BYTES). The floor covers a compiled image DiT at 1024² (bench/results, the budget
# runs); a larger one kept a 4-bit Flux off CUDA graphs on the smallest card it fits.
WORKSPACE_FRACTION = 0.25
WORKSPACE_MIN_BYTES = int(1.5 * 2**30)


def is_dynamic(model) -> bool:
    return bool(getattr(model, "is_dynamic", lambda: False)())


def with_workspace(weights: int) -> int:
    return weights + max(WORKSPACE_MIN_BYTES, int(weights * WORKSPACE_FRACTION))


def fits_whole(model) -> tuple:
    """(fits, GiB needed, GiB the process may hold): whether `model`'s weights (its 8-bit layers at their size, where
    Quantize Model came first) and a compiled model's working memory fit the GPU at once."""
    needed = with_workspace(resident_bytes(model))
    budget = gpu_budget_bytes(model.load_device)
    return needed <= budget, needed / 2**30, budget / 2**30


def streams_quantized_layers(model, budget: float) -> bool:
    """Whether `model` is quantized (Quantize Model came first) and what it holds besides its quantized layers (norms,
    embeddings: ComfyUI's loader places those) fits `budget` bytes with a compiled model's working memory: its
    quantized layers beyond the card's room then stream block by block (comfy_host/quantized_streaming.py), which a
    compiled block runs through as it does resident ones."""
    layers = quantized_modules(model)
    float_part = resident_bytes(model) - sum(tensor_bytes(layer) for layer in layers.values())
    return bool(layers) and with_workspace(float_part) <= budget


def eight_bit_bytes(model) -> int:
    """About what `model` would hold with every 16/32-bit linear weight in 8 bits (Quantize Model's ceiling)."""
    saved = sum(layer.weight.numel() * (layer.weight.element_size() - 1)
                for layer in model.model.diffusion_model.modules()
                if isinstance(layer, torch.nn.Linear) and getattr(layer, "weight", None) is not None
                and layer.weight.element_size() > 1)
    return resident_bytes(model) - saved


def quantize_first_hint(model, budget_gib: float) -> str:
    """A sentence for the log where Quantize Model before Compile Model would make `model` fit the card, else ""."""
    if quantized_modules(model):
        return ""
    needed = with_workspace(eight_bit_bytes(model)) / 2**30
    if needed > budget_gib:
        return ""
    return (f" In 8 bits it would fit ({needed:.1f} GiB): put Quantize Model before Compile Model to compile it with "
            f"CUDA graphs.")


def compile_clone(model):
    """A clone of `model` for Compile Model: on ComfyUI's classic loader where `model` is on dynamic VRAM and fits the
    GPU whole, else a plain clone. Returns (clone, whether the loader changed)."""
    if not is_dynamic(model):
        return model.clone(), False
    fits, needed, budget = fits_whole(model)
    name = type(model.model).__name__
    streamed = not fits and streams_quantized_layers(model, budget * 2**30)
    if not fits and not streamed:
        log.warning("Overdrive Compile Model: %s needs %.1f GiB with its working memory and this GPU allows %.1f: it "
                    "keeps ComfyUI's dynamic VRAM (weights streamed per layer) and its blocks run uncompiled.%s",
                    name, needed, budget, quantize_first_hint(model, budget))
        return model.clone(), False
    clone = classic_clone(model)
    cast = cast_to_layer_dtypes_(clone.model)
    if streamed:
        log.info("Overdrive Compile Model: %s needs %.1f GiB with its working memory and this GPU allows %.1f: loaded "
                 "by ComfyUI's classic loader, its quantized layers beyond the card's room stream block by block from "
                 "pinned host memory, and its blocks compile (CUDA graphs for those whose layers all stay on the GPU)",
                 name, needed, budget)
        return clone, True
    log.info("Overdrive Compile Model: %s fits the GPU whole (%.1f of %.1f GiB): loaded by ComfyUI's classic loader "
             "instead of dynamic VRAM, so its compiled blocks keep their weights on the GPU and replay as CUDA graphs%s.",
             name, needed, budget, f" ({cast} weights cast from the file's dtype to the model's)" if cast else "")
    return clone, True


def cast_to_layer_dtypes_(module: torch.nn.Module) -> int:
    """Each ComfyUI layer's weight and bias in the dtype its layer was built for. With dynamic VRAM on in the process,
    ComfyUI's layers take a file's tensors as they are and cast them at each call; a model its classic loader makes
    then keeps them so too (a bf16 Wan file under fp16 inference failed "mat1 and mat2 must have the same dtype").
    Returns how many tensors were cast."""
    cast = 0
    for layer in module.modules():
        for name in ("weight", "bias"):
            dtype, tensor = getattr(layer, f"{name}_comfy_model_dtype", None), layer._parameters.get(name)
            if dtype is not None and tensor is not None and tensor.dtype != dtype:
                layer._parameters[name] = torch.nn.Parameter(tensor.detach().to(dtype), requires_grad=False)
                cast += 1
    return cast

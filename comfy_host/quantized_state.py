"""What Quantize Model installed on a ModelPatcher, read back: its quantized layers (object patches under the diffusion
model's prefix), their QuantizedSet and device follower, and the size ComfyUI plans the model's loads with."""
import torch

from ..quantization.low_rank import LowRankSidePath, base_of
from .quantized_lora import PREFIX
from .quantized_sets import QuantizedSet
from .layer_tensors import tensor_bytes

FOLLOWER = "overdrive_quantized"  # the name of QuantizedModules in model_options' patches


def followers(patcher) -> list:
    return patcher.model_options.get("transformer_options", {}).get("patches", {}).get(FOLLOWER, [])


def compute_dtype(patcher) -> torch.dtype:
    """The dtype ComfyUI runs the diffusion model in (BaseModel.apply_model's cast)."""
    model = patcher.model
    return getattr(model, "manual_cast_dtype", None) or model.get_dtype()


def is_quantized(module) -> bool:
    """A layer Quantize Model made (or its LoRA side path)."""
    return hasattr(module, "load_float_weight") or isinstance(module, LowRankSidePath)


def quantized_modules(patcher) -> dict:
    """{layer name: quantized layer} that Quantize Model installed on `patcher` (empty if none); a side path's layer."""
    layers = {}
    for key, value in patcher.object_patches.items():
        if key.startswith(PREFIX) and is_quantized(value):
            layers[key[len(PREFIX):]] = base_of(value)
    return layers


def quantized_set_of(patcher) -> QuantizedSet | None:
    follower = next(iter(followers(patcher)), None)
    return None if follower is None else follower.quantized


def resident_bytes(patcher) -> int:
    """What `patcher`'s model holds on the GPU loaded whole: ComfyUI's model_size (the checkpoint's layers, as the
    shared module tree holds them between runs) with the layers Quantize Model replaced at their 8-bit size (and
    their side paths')."""
    follower = next(iter(followers(patcher)), None)
    size = follower.float_size if follower is not None and follower.float_size else patcher.model_size()
    tree = patcher.model.diffusion_model
    for name in quantized_modules(patcher):
        original = patcher.object_patches_backup.get(PREFIX + name) or tree.get_submodule(name)
        size += tensor_bytes(patcher.object_patches[PREFIX + name]) - (0 if is_quantized(original) else
                                                                       tensor_bytes(original))
    return size

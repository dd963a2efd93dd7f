"""Quantized layers as ComfyUI ModelPatcher object patches.

- Weight patches (LoRA) applied BEFORE quantizing are baked into the quantized weights and dropped from the
  clone's patches (ComfyUI could not apply them to an int8/fp8 layer: it has no `weight`).
- Weight patches added AFTER quantizing to a quantized layer are refused with a clear error when they are added
  (LoraLoader), instead of ComfyUI skipping them with "could not patch" at load.
- The quantized layers follow the model between devices: ComfyUI calls `.to(device)` on the patches in
  model_options whenever it loads or offloads the model, also when it reuses already-loaded weights and so
  never moves the module tree itself.
"""
import copy
import hashlib
import uuid

import torch

import comfy.lora
import comfy.utils
from comfy.patcher_extension import CallbacksMP

PREFIX = "diffusion_model."
LORA_AFTER_QUANTIZE = (
    "{key} belongs to a layer that Quantize Model (Overdrive) replaced with an 8-bit layer, so this LoRA (or other "
    "weight patch) cannot be applied to it after quantizing. Put LoraLoader before QuantizeModel: LoRAs applied "
    "before it are baked into the quantized weights."
)


def patch_keys(name: str) -> tuple:
    return f"{PREFIX}{name}.weight", f"{PREFIX}{name}.bias"


def patched_tensor(patcher, key: str, device):
    """The tensor at `key` with `patcher`'s weight patches applied, as ModelPatcher.patch_weight_to_device
    computes it (in float32 from the unpatched original, then cast to the original's dtype)."""
    original = patcher.backup[key] if key in patcher.backup else comfy.utils.get_attr(patcher.model, key)
    original = getattr(original, "weight", original)  # the backup holds (weight, inplace_update) tuples
    if original is None or key not in patcher.patches:
        return original
    weight = original.to(device=device, dtype=torch.float32, copy=True)
    return comfy.lora.calculate_weight(patcher.patches[key], weight, key).to(original.dtype)


def bake_weight_patches(patcher, modules: dict, device) -> list:
    """Re-quantize each quantized layer that has weight patches from its patched weight, and drop those patches.
    Returns the names of the layers baked."""
    baked = []
    for name, module in modules.items():
        keys = patch_keys(name)
        if any(key in patcher.patches for key in keys):
            weight, bias = (patched_tensor(patcher, key, device) for key in keys)
            module.load_float_weight(weight, bias)
            baked.append(name)
    for name in baked:
        for key in patch_keys(name):
            patcher.patches.pop(key, None)
    if baked:
        patcher.patches_uuid = uuid.uuid4()  # other weights than the input MODEL's: ComfyUI must not share them
    return baked


class RefuseQuantizedPatches:
    """Refuses LoRA (weight patches) on quantized layers: ModelPatcher.add_patches checks the model's state_dict, where
    a quantized layer still has its float keys, so the patch would be accepted, then could not apply to the 8-bit
    layer at load.
    An ON_CLONE callback, copied to every clone, gives each clone an add_patches that checks every key first and
    raises before anything is added."""

    def __init__(self, keys):
        self.keys = frozenset(keys)

    def guard(self, patcher) -> None:
        add_patches, refused = type(patcher).add_patches, self.keys

        def checked_add_patches(patches, *args, **kwargs):
            for k in patches:
                key = k if isinstance(k, str) else k[0]
                if key in refused:
                    raise ValueError(LORA_AFTER_QUANTIZE.format(key=key))
            return add_patches(patcher, patches, *args, **kwargs)

        patcher.add_patches = checked_add_patches

    def on_clone(self, source, clone) -> None:
        self.guard(clone)


class QuantizedModules:
    """Rides in model_options["transformer_options"]["patches"] (ComfyUI's model code only reads its own patch
    names there) so that ModelPatcher.model_patches_to moves the quantized layers with the model.

    It also moves the float layers they replace (`originals`, shared with the input MODEL) to the offload device
    whenever the quantized model is loaded: they are out of the module tree while it runs, so ComfyUI would leave
    them on the GPU (where calibration put them) beside their 8-bit copies. A later load of the float model moves
    its whole tree, these layers included, back to its device."""

    forward_inert = True  # never called by the model's forward: DeepCache may run around it

    def __init__(self, modules: dict, originals: dict | None = None, offload_device=None):
        self.modules = modules
        self.originals = originals or {}
        self.offload_device = offload_device

    def to(self, device_or_dtype):
        if not isinstance(device_or_dtype, torch.dtype):  # the quantized storage keeps its dtype
            for module in self.modules.values():
                module.to(device_or_dtype)
            if self.offload_device is not None and torch.device(device_or_dtype) != torch.device(self.offload_device):
                for module in self.originals.values():
                    module.to(self.offload_device)
        return self

    def __deepcopy__(self, memo):  # ModelPatcher.clone deep-copies model_options: clones share the layers
        return self


def install(patcher, modules: dict) -> None:
    """Object patches for the quantized layers, the LoRA-after guard and the device follower, on `patcher`."""
    tree = patcher.model.diffusion_model
    originals = {name: tree.get_submodule(name) for name in modules}
    originals = {name: module for name, module in originals.items() if not hasattr(module, "load_float_weight")}
    for name, module in modules.items():
        patcher.add_object_patch(PREFIX + name, module)
    guard = RefuseQuantizedPatches([key for name in modules for key in patch_keys(name)])
    guard.guard(patcher)
    patcher.add_callback(CallbacksMP.ON_CLONE, guard.on_clone)
    patcher.set_model_patch(QuantizedModules(modules, originals, patcher.offload_device), "overdrive_quantized")


def patches_digest(patches: dict) -> str:
    """sha256 of a ModelPatcher's weight patches (keys, strengths and tensors): part of the cache key."""
    digest = hashlib.sha256()

    def feed(value):
        if isinstance(value, torch.Tensor):
            digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, (list, tuple)):
            digest.update(b"[")
            for item in value:
                feed(item)
            digest.update(b"]")
        else:
            digest.update(repr(value).encode())

    for key in sorted(patches):
        digest.update(key.encode())
        feed(patches[key])
    return digest.hexdigest()


def quantized_modules(patcher) -> dict:
    """{layer name: quantized module} that Quantize Model installed on `patcher` (empty if none)."""
    return {key[len(PREFIX):]: value for key, value in patcher.object_patches.items()
            if key.startswith(PREFIX) and hasattr(value, "load_float_weight")}


def requantize_onto(patcher, diffusion_model) -> list:
    """SwitchWeights on a quantized model: the same layers, the same format and scales rule, quantized again from
    `diffusion_model`'s weights (the new checkpoint's), without re-measuring. New modules, so the model that was
    running keeps its own. Returns the names of the layers re-quantized."""
    old = quantized_modules(patcher)
    if not old:
        return []
    fresh = {}
    for name, module in old.items():
        layer = diffusion_model.get_submodule(name)
        fresh[name] = copy.deepcopy(module).load_float_weight(layer.weight, layer.bias)
    patcher.model_options["transformer_options"]["patches"]["overdrive_quantized"] = []  # the old layers' follower
    install(patcher, fresh)
    return sorted(fresh)


def float_view(patcher):
    """`patcher`'s diffusion model as its checkpoint has it: where quantized layers are swapped into the shared
    module tree right now (a loaded quantized model), the float layers they replaced. Shares every tensor; only
    read (SwitchWeights builds its twin from it), never run."""
    current = patcher.model.diffusion_model
    originals = {key[len(PREFIX):]: module for key, module in patcher.object_patches_backup.items()
                 if key.startswith(PREFIX) and isinstance(module, torch.nn.Module)}
    if not originals:
        return current
    memo = {id(current.get_submodule(name)): original for name, original in originals.items()}
    memo.update({id(t): t for t in current.state_dict(keep_vars=True).values()})
    memo.update({id(v): v for v in current.__dict__.values() if callable(v) and not isinstance(v, torch.nn.Module)})
    return copy.deepcopy(current, memo)
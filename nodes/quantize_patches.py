"""Quantized layers as ComfyUI ModelPatcher object patches.

- Weight patches (LoRA) applied BEFORE quantizing are baked into the quantized weights and dropped from the
  clone's patches (ComfyUI could not apply them to an int8/fp8 layer: it has no `weight`).
- Weight patches added AFTER quantizing to a quantized layer are refused with a clear error when they are added
  (LoraLoader), instead of ComfyUI skipping them with "could not patch" at load.
- The quantized layers follow the model between devices (QuantizedModules), and the float layers they replace
  leave the GPU while they run.
"""
import hashlib
import logging
import uuid
import weakref

import torch

import comfy.lora
import comfy.sampler_helpers
import comfy.utils
from comfy.patcher_extension import CallbacksMP, WrappersMP

from ..compiler.switch_weights import structural_copy
from ..quantization import gelu_fusion
from ..quantization.cache import tensor_hash
from ..quantization.kernels import fp8_gemm_gelu_runs_as
from ..quantization.linear_layers import dequantized, float_weight
from ..quantization.modules import requantize
from .load_state import LAYER_LOADER_STATE, forget_load_state
from .quantized_streaming import StreamedBlocks, place, tensor_bytes

log = logging.getLogger("overdrive.quantization")
PREFIX = "diffusion_model."
CLASS_PATCH = ".__class__"  # the key suffix of the object patches that give the fused MLPs' modules their classes
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
    original = dequantized(original)  # a layer the checkpoint stores in low bits: LoRA applies to its float weight
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
            home = on_device(module)  # quantized where the patched weight was computed, then back where it waits
            module.to(device).load_float_weight(weight, bias).to(home)
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


FOLLOWER = "overdrive_quantized"  # the name of QuantizedModules in model_options' patches
ACTIVATIONS_KEY = "overdrive_quantized_activations"  # the PREPARE_SAMPLING wrapper's key (record_activations)
# model_options key: the working memory a compiled model needs beside one call's activations (Compile Model sets it),
# kept free too where some quantized layers stream
WORKSPACE_KEY = "overdrive_compiled_workspace"
FLOAT_HOME = torch.device("cpu")  # where the float layers that 8-bit layers replaced wait while the quantized model runs


class QuantizedModules:
    """Where the 8-bit layers and the float layers they replace live, as ComfyUI loads and unloads the model.

    It rides in model_options["transformer_options"]["patches"] (ComfyUI's model code only reads its own patch names
    there), so ModelPatcher.model_patches_to calls `.to(device)` on it at every load and detach; ON_DETACH and
    ON_CLEANUP callbacks tell it more. Clones share it (and the layers).
    - Loading: the 8-bit layers go to the load device; the float layers they replace (out of the module tree while the
      quantized model runs, shared with the input MODEL) go to the CPU, whatever ComfyUI's offload device, so 8-bit
      weights lower VRAM in every memory mode (--gpu-only and --highvram offload to the GPU).
    - Detaching: ComfyUI 0.7 detaches a loaded model without unpatching before every sampling run (it pops the model
      as a clone of itself and loads it again), when another clone of the model loads, and when a clone is collected.
      None of these moves weights, so nothing moves here either (moving on each copied Flux's fp8 weights to and fro
      several times per image). Only a real unload sends the 8-bit layers to the offload device.
    - A float clone of the same checkpoint that ComfyUI runs right after (it reuses the loaded weights without moving
      them) finds its layers on the CPU: a pre-hook on the diffusion model puts them beside the input at its first
      call, once.
    """

    forward_inert = True  # never called by the model's forward: DeepCache may run around it

    def __init__(self, modules: dict, originals: dict | None = None, load_device=None, offload_device=None,
                 tree: torch.nn.Module | None = None, owner=None):
        self.modules = modules
        self.owner = None if owner is None else weakref.ref(owner)  # ComfyUI's BaseModel: its dynamic-VRAM cache
        self.originals = originals or {}
        self.load_device = torch.device(load_device) if load_device is not None else None
        self.offload_device = torch.device(offload_device) if offload_device is not None else None
        self.tree = tree
        self.homes = {}  # name -> where ComfyUI had the float layer when a load sent it to the CPU (its way back)
        self.streaming = StreamedBlocks()  # the 8-bit layers a short card has no room for
        self.streamed_bytes = 0  # of them, copied in at each model call since the last load
        self.activations_bytes = 0  # ComfyUI's estimate of one model call's activations in this sampling
        self.workspace_bytes = 0  # the sampled model's compiled working memory (WORKSPACE_KEY), 0 uncompiled
        self.float_size = 0  # the checkpoint's size with its float layers (install_quantized sets it)
        self.return_hook = None
        self._slots = (None, [])  # (tree, [(parent, attribute, 8-bit layer, float layer)]): see slots()

    def to(self, device_or_dtype):
        if isinstance(device_or_dtype, torch.dtype):  # the 8-bit storage keeps its dtypes
            return self
        device = torch.device(device_or_dtype)
        if device == self.offload_device and device != self.load_device:
            return self  # a detach: weights stay where they are (see on_detach)
        if device != FLOAT_HOME:
            # The float layers leave first: loaded beside them, the 8-bit layers would need both on the card at once.
            # One ComfyUI had left in host memory (dynamic VRAM, a partial load) has no GPU home to go back to.
            for name, original in self.originals.items():
                if (home := on_device(original)) not in (None, FLOAT_HOME):
                    self.homes[name] = home
            move(self.originals.values(), FLOAT_HOME)
            # Out of the tree, ComfyUI's unpatching will not clear their marks: they would come back "patched" and
            # skip the LoRA of the next model loaded. Their weights hold no patch here (ones on these layers were
            # baked, and the model was unpatched before this load), so nothing is lost.
            forget_load_state(self.originals.values())
            if self.tree is not None and self.originals and self.return_hook is None:
                self.return_hook = return_hook(self)
        self.streamed_bytes = 0
        if self.tree is None or device.type != "cuda":
            move(self.modules.values(), device)
        elif streamed := place(self.tree, self.modules, device, self.streaming, move, self.free_cache(device),
                               self.activations_bytes, self.workspace_bytes):
            self.streamed_bytes = streamed
            log.info("Overdrive quantization: the card's budget leaves no room for every quantized layer; %.2f GiB of "
                     "them stay in pinned host memory and are copied in block by block at each model call.",
                     streamed / 2**30)
        return self

    def free_cache(self, device):
        """What frees ComfyUI's dynamic-VRAM cache of this model's float weights on `device` (comfy-aimdo's VBAR keeps
        them on the card while memory allows, the float layers that quantized ones replace among them, which only the
        calibration run used), or None without one."""
        vbars = getattr(self.owner() if self.owner is not None else None, "dynamic_vbars", None) or {}
        vbar = vbars.get(device)
        return None if vbar is None else vbar.free_memory

    def on_detach(self, patcher, unpatch_all) -> None:
        if unpatch_all and self in followers(patcher) and self.offload_device is not None:
            self.streaming.stop()
            move(self.modules.values(), self.offload_device)  # unloaded: the float layers went with the tree

    def on_cleanup(self, patcher) -> None:
        """After each sampling run (also a stopped one): the checkpoint's float layers and classes back into the
        shared module tree. ComfyUI leaves object patches applied until another clone loads, and the next prompt's
        nodes read that tree: LoraLoader accepts only keys of its state_dict (with 8-bit layers there, a LoRA for
        another clone of this model silently lost those layers), Compile Model keys its graph by it (a switched copy of
        it too). The next load swaps the 8-bit layers and classes in again, as ComfyUI re-applies object patches at
        every load."""
        if self not in followers(patcher):
            return
        self.streaming.stop()  # hooks on the shared tree must not keep this model's layers alive; the next load sets them
        # ComfyUI's dynamic-VRAM loader recorded the 8-bit layers' buffers to restore at the next load (a record its
        # clones share): restored over the float layers put back here, they fail ("attribute 'bias' already exists").
        under_layers = tuple(f"diffusion_model.{name}." for name in self.modules)
        backups = getattr(patcher, "backup_buffers", {})
        for key in [key for key in backups if key.startswith(under_layers)]:
            del backups[key]
        tree = patcher.model.diffusion_model
        for key in patcher.object_patches:  # the fused MLPs' class patches (install_quantized)
            if key.startswith(PREFIX) and key.endswith(CLASS_PATCH):
                gelu_fusion.restore_class(tree.get_submodule(key[len(PREFIX):-len(CLASS_PATCH)]))
        for look_up_again in (False, True):  # again: a layer not where it was found (a container replaced since)
            missed = False
            for parent, attribute, quantized, original in self.slots(tree, look_up_again):
                if parent._modules.get(attribute) is quantized:
                    setattr(parent, attribute, original)
                else:
                    missed = True
            if not missed:
                return

    def slots(self, tree, look_up_again: bool = False) -> list:
        """Where each swapped layer sits in `tree`, looked up once per tree: a path walk per layer at every run was a
        measurable share of an SDXL image's host time (bench/host_timers.py)."""
        if self._slots[0] is not tree or look_up_again:
            slots = []
            for name, original in self.originals.items():
                parent_name, _, attribute = name.rpartition(".")
                parent = tree.get_submodule(parent_name) if parent_name else tree
                slots.append((parent, attribute, self.modules[name], original))
            self._slots = (tree, slots)
        return self._slots[1]

    def __deepcopy__(self, memo):  # ModelPatcher.clone deep-copies model_options: clones share the layers
        return self


def return_hook(follower: QuantizedModules):
    """The pre-hook on the checkpoint's module tree that brings the float layers back for a float clone, once, to
    where ComfyUI had loaded each (on a short card, all of them onto the GPU would not fit).

    It holds the float layers (the checkpoint's own) and not the follower: the tree is shared by every clone, and a
    hook holding the follower kept each dropped quantized model's 8-bit layers alive until a float clone ran
    (bench/results/2026-11-25_h200_quantize_memory_repeat_wan22_compile.json). It still fires after its quantized model
    is gone, when the float layers are needed most."""
    originals, homes, follower_ref = follower.originals, follower.homes, weakref.ref(follower)
    name, original = next(iter(originals.items()))  # ComfyUI swaps object patches all together: one tells
    handle = None

    def hook(tree, args):
        if tree.get_submodule(name) is not original:
            return  # the quantized model (or another) runs: nothing to bring back
        for layer_name, layer in originals.items():
            if layer_name in homes:
                move([layer], homes[layer_name])
        handle.remove()
        live = follower_ref()
        if live is not None:
            live.return_hook = None
    handle = follower.tree.register_forward_pre_hook(hook)
    return handle


def on_device(module) -> torch.device | None:
    """The device of `module`'s first tensor (a layer moves as a whole). Read from the tensor dicts: `state_dict()`
    per layer, over a model's hundreds of layers, showed at every sampling run."""
    for layer in module.modules():
        for tensors in (layer._parameters, layer._buffers):
            for tensor in tensors.values():
                if tensor is not None:
                    return tensor.device
    return None


def move(modules, device) -> None:
    """`module.to(device)` for each module not already there."""
    for module in modules:
        current = on_device(module)
        if current is not None and current != torch.device(device):
            module.to(device)


def followers(patcher) -> list:
    return patcher.model_options.get("transformer_options", {}).get("patches", {}).get(FOLLOWER, [])


def compute_dtype(patcher) -> torch.dtype:
    """The dtype ComfyUI runs the diffusion model in (BaseModel.apply_model's cast)."""
    model = patcher.model
    return getattr(model, "manual_cast_dtype", None) or model.get_dtype()


def install_quantized(patcher, modules: dict, float_size: int | None = None) -> None:
    """Object patches for the quantized layers (and for the activations of the MLPs whose two fp8 GEMMs run as one
    fused pair, quantization/gelu_fusion.py), the LoRA-after guard and the device follower, on `patcher`; its size as
    ComfyUI reads it (ModelPatcher.size) becomes the quantized model's. `float_size`: the checkpoint's float size where
    `patcher` already reports a quantized one (a re-install)."""
    float_size = patcher.model_size() if float_size is None else float_size
    tree = patcher.model.diffusion_model
    originals = {name: tree.get_submodule(name) for name in modules}
    originals = {name: module for name, module in originals.items() if not hasattr(module, "load_float_weight")}
    for name, module in modules.items():
        patcher.add_object_patch(PREFIX + name, module)
    fused = gelu_fusion.fuse(tree, modules, compute_dtype(patcher))
    for name, cls in fused.items():
        patcher.add_object_patch(f"{PREFIX}{name}{CLASS_PATCH}", cls)
    if fused:
        log.info("Overdrive quantization: %d MLP(s) run their first fp8 GEMM, tanh-GELU and the second GEMM's input "
                 "cast %s.", gelu_fusion.mlp_count(fused),
                 fp8_gemm_gelu_runs_as(patcher.load_device))
    guard = RefuseQuantizedPatches([key for name in modules for key in patch_keys(name)])
    guard.guard(patcher)
    patcher.add_callback(CallbacksMP.ON_CLONE, guard.on_clone)
    follower = QuantizedModules(modules, originals, patcher.load_device, patcher.offload_device, tree, patcher.model)
    follower.float_size = float_size
    patcher.add_callback(CallbacksMP.ON_DETACH, follower.on_detach)
    patcher.add_callback(CallbacksMP.ON_CLEANUP, follower.on_cleanup)
    patcher.remove_wrappers_with_key(WrappersMP.PREPARE_SAMPLING, ACTIVATIONS_KEY)
    patcher.add_wrapper_with_key(WrappersMP.PREPARE_SAMPLING, ACTIVATIONS_KEY, record_activations)
    patcher.set_model_patch(follower, FOLLOWER)
    # ComfyUI loads a model whole (model.to(device), every tensor) only where its size fits; told the float size, it
    # loaded a 4-bit Wan 14B that fits a short card partially, leaving the blocks' own modulation tensors in host
    # memory, which kept every compiled block off CUDA graphs.
    patcher.size = resident_bytes(patcher)


def record_activations(executor, model, noise_shape, conds, *args, **kwargs):
    """A PREPARE_SAMPLING wrapper: ComfyUI's own estimate of one model call's activations for this sampling (what its
    partial loader keeps free, comfy.sampler_helpers.estimate_memory), kept for placing the quantized layers at the
    load that follows. A video model's activations outgrow the fixed reserve (gpu_budget.ACTIVATIONS_BYTES): Wan 14B's
    8-bit layers placed beside it ran a short card out of memory in the first step."""
    _, minimum = comfy.sampler_helpers.estimate_memory(model, noise_shape, conds)
    for follower in followers(model):  # shared by clones: set for the one sampling now
        follower.activations_bytes = int(minimum)
        follower.workspace_bytes = int(model.model_options.get(WORKSPACE_KEY, 0))
    return executor(model, noise_shape, conds, *args, **kwargs)


def patches_digest(patches: dict) -> str:
    """sha256 of a ModelPatcher's weight patches (keys, strengths and tensors): part of the cache key. Equal for the
    same LoRA loaded twice: ComfyUI's weight adapters (LoRAAdapter, ...) and patch functions are fed by class or name
    and their tensors, never by repr (which holds the object's address, so no LoRA'd model ever hit the cache)."""
    digest = hashlib.sha256()

    def feed(value):
        if isinstance(value, torch.Tensor):
            digest.update(f"T{value.dtype}{tuple(value.shape)}{tensor_hash(value)}".encode())
        elif isinstance(value, (list, tuple)):
            digest.update(b"[")
            for item in value:
                feed(item)
            digest.update(b"]")
        elif isinstance(getattr(value, "weights", None), (list, tuple)):  # comfy.weight_adapter.WeightAdapterBase
            digest.update(f"A{type(value).__module__}.{type(value).__qualname__}".encode())
            feed(value.weights)
        elif callable(value):
            digest.update(f"F{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}".encode())
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


def resident_bytes(patcher) -> int:
    """What `patcher`'s model holds on the GPU loaded whole: ComfyUI's model_size (the checkpoint's layers, as the
    shared module tree holds them between runs) with the layers Quantize Model replaced at their 8-bit size."""
    follower = next(iter(followers(patcher)), None)
    size = follower.float_size if follower is not None and follower.float_size else patcher.model_size()
    tree = patcher.model.diffusion_model
    for name, module in quantized_modules(patcher).items():
        original = patcher.object_patches_backup.get(PREFIX + name) or tree.get_submodule(name)
        size += tensor_bytes(module) - (0 if original is module else tensor_bytes(original))
    return size


def requantize_onto(patcher, diffusion_model) -> list:
    """SwitchWeights on a quantized model: the same layers, the same format and scales rule, quantized again from
    `diffusion_model`'s weights (the new checkpoint's), without re-measuring. New modules, so the model that was
    running keeps its own. Returns the names of the layers re-quantized."""
    old = quantized_modules(patcher)
    if not old:
        return []
    state = {}
    for name in old:  # each layer's float weights, dequantized where the new checkpoint stores the layer in low bits
        layer = diffusion_model.get_submodule(name)
        state[f"{name}.weight"], state[f"{name}.bias"] = float_weight(layer), layer.bias
    fresh = requantize(old, state, copy=True)
    reinstall(patcher, fresh)
    return sorted(fresh)


def retarget(patcher) -> int:
    """After ComfyUI made `patcher`'s model anew (Compile Model's loader change, nodes/dynamic_vram.py): the same
    quantized layers installed over the new module tree, whose float layers they now stand in for. Returns how many."""
    modules = quantized_modules(patcher)
    if modules:
        reinstall(patcher, modules)
    return len(modules)


def reinstall(patcher, modules: dict) -> None:
    """`modules` installed on `patcher` in place of the quantized layers it has (their follower dropped), its float
    size carried over."""
    old = followers(patcher)
    float_size = old[0].float_size if old else None
    patcher.model_options["transformer_options"]["patches"][FOLLOWER] = []
    install_quantized(patcher, modules, float_size)


def float_view(patcher):
    """`patcher`'s diffusion model as its checkpoint has it: where quantized layers are swapped into the shared
    module tree right now (a loaded quantized model), the float layers they replaced and the classes the fused MLPs
    swapped. Shares every tensor; only read (SwitchWeights builds its twin from it), never run."""
    current = patcher.model.diffusion_model
    originals = {key[len(PREFIX):]: module for key, module in patcher.object_patches_backup.items()
                 if key.startswith(PREFIX) and isinstance(module, torch.nn.Module)}
    if not originals:
        return current
    shared = {id(current.get_submodule(name)): original for name, original in originals.items()}
    # every tensor: the parameters themselves too, since ComfyUI's quantized layers give their state dict the stored
    # parts of a QuantizedTensor weight instead (whose wrapper cannot be deep-copied)
    tensors = (*current.parameters(), *current.buffers(), *current.state_dict(keep_vars=True).values())
    shared.update({id(t): t for t in tensors})
    view = structural_copy(current, shared, LAYER_LOADER_STATE)  # the loader's handles and views stay with `current`
    for module in view.modules():  # the fused MLPs' own classes too (a compiled graph is keyed by the classes)
        gelu_fusion.restore_class(module)
    return view
"""Quantized layers as ComfyUI ModelPatcher object patches.

- Weight patches (LoRA) on a quantized layer run beside it as a low-rank side path (comfy_host/quantized_lora.py), added
  before or after Quantize Model; one that is not low-rank is baked into a copy of the layer where Quantize Model sees
  it and refused with a clear error after it.
- The quantized layers follow the model between devices (QuantizedModules), and the float layers they replace leave
  the GPU while they run, for the file they were loaded from where it holds them (comfy_host/file_weights.py).
"""
import copy
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
from ..quantization.kernels import fp8_gemm_gelu_runs_as
from ..quantization.linear_layers import dequantized, float_weight
from ..quantization.low_rank import LowRankSidePath, base_of, layer_shape
from ..quantization.modules import requantize
from . import file_weights
from .load_state import LAYER_LOADER_STATE, forget_load_state
from .quantized_lora import PREFIX, NotLowRank, bias_key, place_side_paths, term_of, weight_key
from .quantized_lora import SidePaths
from .quantized_sets import QuantizedSet
from .quantized_streaming import place, tensor_bytes

log = logging.getLogger("overdrive.quantization")
CLASS_PATCH = ".__class__"  # the key suffix of the object patches that give the fused MLPs' modules their classes
ROUTER_KEY = "overdrive_quantized_patches"  # the ON_CLONE callback that routes each clone's add_patches
LOAD_KEY = "overdrive_quantized_load"  # the ON_LOAD callback that sends float layers to their file


def patch_keys(name: str) -> tuple:
    return weight_key(name), bias_key(name)


def patched_tensor(patcher, key: str, device, float_tree):
    """The tensor at `key` with `patcher`'s weight patches applied, as ModelPatcher.patch_weight_to_device computes it
    (in float32 from the unpatched original, then cast to the original's dtype). `float_tree`: the diffusion model with
    its float layers (float_view)."""
    original = patcher.backup[key] if key in patcher.backup else comfy.utils.get_attr(float_tree, key[len(PREFIX):])
    original = getattr(original, "weight", original)  # the backup holds (weight, inplace_update) tuples
    if original is None or key not in patcher.patches:
        return original
    original = dequantized(original)  # a layer the checkpoint stores in low bits: LoRA applies to its float weight
    weight = original.to(device=device, dtype=torch.float32, copy=True)
    return comfy.lora.calculate_weight(patcher.patches[key], weight, key).to(original.dtype)


def bake_weight_patches(patcher, layers: dict, names, float_tree, device) -> dict:
    """Copies of `layers`' `names` ({name: quantized layer}) re-quantized on `device` from their float weights in
    `float_tree` with `patcher`'s weight patches applied, those patches dropped from `patcher`: for the patches no side
    path runs (LoHa, LoKr, DoRA, full or bias differences). The shared layers stay as they are; the copies wait where
    ComfyUI keeps offloaded weights until the model loads. Returns {name: baked copy}."""
    baked = {}
    for name in names:
        weight, bias = (patched_tensor(patcher, key, device, float_tree) for key in patch_keys(name))
        layer = copy.deepcopy(layers[name]).to(device)
        gelu_fusion.unlink(layer)
        baked[name] = layer.load_float_weight(dequantized(weight), bias).to(patcher.offload_device)
    for name in baked:
        for key in patch_keys(name):
            patcher.patches.pop(key, None)
    if baked:
        patcher.patches_uuid = uuid.uuid4()  # other weights than the input MODEL's: ComfyUI must not share them
    return baked


class QuantizedPatchRouter:
    """Weight patches added to a clone of a quantized model (LoraLoader after Quantize Model): ModelPatcher.add_patches
    checks keys against the model's state_dict, where a quantized layer still has its float keys, so they would be
    accepted and then dropped at load. Each clone's add_patches (set through an ON_CLONE callback, copied to every
    clone) checks every key on a quantized layer first: a low-rank LoRA is added and runs beside the layer (the clone's
    object patches take the side paths); anything else raises before anything is added."""

    def __init__(self, quantized: QuantizedSet):
        self.quantized = quantized

    def guard(self, patcher) -> None:
        add_patches, layers = type(patcher).add_patches, self.quantized.layers

        def routed_add_patches(patches, strength_patch=1.0, strength_model=1.0):
            touched = False
            for k in patches:
                key, offset, function = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2
                                                                                     else None)
                name = quantized_name(key)
                if name in layers:
                    if quantized_modules(patcher).get(name) is not layers[name]:
                        raise NotLowRank(f"{key}: this layer's earlier patches were baked into its 8-bit weights by "
                                         "Quantize Model (Overdrive), so no other LoRA can be added to it after "
                                         "quantizing. Put this LoRA loader before Quantize Model too.")
                    if key == bias_key(name):
                        raise NotLowRank(f"{key}: a bias patch on a layer Quantize Model (Overdrive) replaced. Put "
                                         "this LoRA loader before Quantize Model: it is baked into the quantized "
                                         "weights there.")
                    term_of((strength_patch, patches[k], strength_model, offset, function), key,
                            layer_shape(layers[name]))
                    touched = True
            added = add_patches(patcher, patches, strength_patch, strength_model)
            if touched:
                place_quantized(patcher, self.quantized)
            return added

        patcher.add_patches = routed_add_patches

    def on_clone(self, source, clone) -> None:
        self.guard(clone)

    def on_hook_patches(self, patcher, *args) -> None:
        """ComfyUI's hook LoRAs (a LoRA scheduled on conditioning) patch weights while sampling, which the quantized
        layers do not have: ComfyUI skips those keys. Said once per model, with the fix."""
        keys = {key for patches in patcher.hook_patches.values() for key in patches}
        hit = sorted(name for name in self.quantized.layers if weight_key(name) in keys)
        if hit and not getattr(patcher, "_overdrive_hooks_warned", False):
            patcher._overdrive_hooks_warned = True
            log.warning("Overdrive quantization: a hook LoRA (scheduled on conditioning) patches %d quantized layer(s) "
                        "(%s...), which it cannot: those layers run without it. Load that LoRA with a LoRA loader on "
                        "the model (before or after Quantize Model) instead.", len(hit), hit[0])


def quantized_name(key: str) -> str | None:
    if not key.startswith(PREFIX):
        return None
    for suffix in (".weight", ".bias"):
        if key.endswith(suffix):
            return key[len(PREFIX):-len(suffix)]
    return None


def place_quantized(patcher, quantized: QuantizedSet) -> None:
    """`patcher`'s object patches for the quantized layers (side paths where its LoRAs need them), its size, and its
    forward rebuilt over them (compiled graphs are keyed by the layers swapped in)."""
    from .forward_patch import rebuild
    place_side_paths(patcher, quantized.side_paths, quantized_modules(patcher))
    patcher.size = resident_bytes(patcher)
    rebuild(patcher)


FOLLOWER = "overdrive_quantized"  # the name of QuantizedModules in model_options' patches
ACTIVATIONS_KEY = "overdrive_quantized_activations"  # the PREPARE_SAMPLING wrapper's key (record_activations)
# model_options key: the working memory a compiled model needs beside one call's activations (Compile Model sets it),
# kept free too where some quantized layers stream
WORKSPACE_KEY = "overdrive_compiled_workspace"
FLOAT_HOME = torch.device("cpu")  # where the float layers that 8-bit layers replaced wait while the quantized model runs


class QuantizedModules:
    """Where the 8-bit layers and the float layers they replace live, as ComfyUI loads and unloads the model.

    It rides in model_options["transformer_options"]["patches"] (ComfyUI's model code only reads its own patch names
    there), so ModelPatcher.model_patches_to calls `.to(device)` on it at every load and detach; ON_LOAD, ON_DETACH and
    ON_CLEANUP callbacks tell it more. Clones share it (and the layers).
    - Loading: the 8-bit layers (and their LoRA side paths) go to the load device; the float layers they replace (out
      of the module tree while the quantized model runs, shared with the input MODEL) leave the GPU, whatever ComfyUI's
      offload device, so 8-bit weights lower VRAM in every memory mode (--gpu-only and --highvram offload to the GPU):
      to the file they were loaded from where it holds them, else to a host copy (comfy_host/file_weights.py). Once more
      after the load: ComfyUI's unpatching may have copied them to the host meanwhile.
    - Detaching: ComfyUI detaches a loaded model without unpatching before every sampling run (it pops the model as a
      clone of itself and loads it again), when another clone of the model loads, and when a clone is collected. None
      of these moves weights, so nothing moves here either (moving on each copied Flux's fp8 weights to and fro
      several times per image). Only a real unload sends the 8-bit layers to the offload device.
    - A float clone of the same checkpoint that ComfyUI runs right after (it reuses the loaded weights without moving
      them) finds its layers on the host: a pre-hook on the diffusion model puts them beside the input at its first
      call, once.
    """

    forward_inert = True  # never called by the model's forward: DeepCache may run around it

    def __init__(self, quantized: QuantizedSet, modules: dict, originals: dict | None = None, load_device=None,
                 offload_device=None, tree: torch.nn.Module | None = None, owner=None, source_path=None,
                 backup=None):
        self.quantized = quantized
        self.modules = modules
        self.owner = None if owner is None else weakref.ref(owner)  # ComfyUI's BaseModel: its dynamic-VRAM cache
        self.originals = originals or {}
        self.load_device = torch.device(load_device) if load_device is not None else None
        self.offload_device = torch.device(offload_device) if offload_device is not None else None
        self.tree = tree
        self.source_path = source_path  # the file ComfyUI's loader read the model from (file_weights.source_file)
        self.backup = backup if backup is not None else {}  # the patchers' shared record of weights patched in place
        self.file_tensors = None  # {key: the file's tensor} of the float layers, read once
        self.homes = {}  # name -> where ComfyUI had the float layer when a load sent it to the host (its way back)
        self.streamed_bytes = 0  # of the 8-bit layers, copied in at each model call since the last load
        self.activations_bytes = 0  # ComfyUI's estimate of one model call's activations in this sampling
        self.workspace_bytes = 0  # the sampled model's compiled working memory (WORKSPACE_KEY), 0 uncompiled
        self.float_size = 0  # the checkpoint's size with its float layers (install_quantized sets it)
        self.logged = False  # where the float layers went, logged once
        self.return_hook = None
        self._slots = (None, [])  # (tree, [(parent, attribute, 8-bit layer, float layer)]): see slots()

    @property
    def streaming(self):
        return self.quantized.streaming  # the layers' pinned host copies: one per layer, whichever clone runs them

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
            self.float_layers_off_gpu()
            # Out of the tree, ComfyUI's unpatching will not clear their marks: they would come back "patched" and
            # skip the LoRA of the next model loaded. Their weights hold no patch here (ones on these layers run
            # beside them or were baked, and the model was unpatched before this load), so nothing is lost.
            forget_load_state(self.originals.values())
            if self.tree is not None and self.originals and self.return_hook is None:
                self.return_hook = return_hook(self)
        self.streamed_bytes = 0
        self.quantized.side_paths.to(device)
        if self.tree is None or device.type != "cuda":
            move(self.modules.values(), device)
        elif streamed := place(self.tree, self.modules, device, self.streaming, move, self.free_cache(device),
                               self.activations_bytes, self.workspace_bytes):
            self.streamed_bytes = streamed
            log.info("Overdrive quantization: the card's budget leaves no room for every quantized layer; %.2f GiB of "
                     "them stay in pinned host memory and are copied in block by block at each model call.",
                     streamed / 2**30)
        return self

    def float_layers_off_gpu(self) -> None:
        """The float layers pointed at their file where it holds them, else copied to the host; logged once."""
        if self.file_tensors is None:
            self.file_tensors = file_weights.file_tensors(self.owner() if self.owner else None, self.source_path,
                                                          self.originals)
        patched = {key for key in self.backup if key.startswith(PREFIX)}
        to_file = file_weights.point_at_file(self.originals, self.file_tensors, patched)
        away = [layer for layer in self.originals.values() if on_device(layer) not in (None, FLOAT_HOME)]
        copied = sum(tensor_bytes(layer) for layer in away)
        move(away, FLOAT_HOME)
        if (to_file or copied) and not self.logged:
            self.logged = True
            log.info("Overdrive quantization: the float layers the quantized ones replace left the GPU: %.2f GiB "
                     "back to the file they were loaded from%s.", to_file / 2**30,
                     f", {copied / 2**30:.2f} GiB copied to host memory (not found in the file)" if copied else "")

    def on_load(self, patcher, *args) -> None:
        """After ComfyUI's load: float layers it brought onto the GPU meanwhile (its unpatching moves the whole tree)
        leave it again."""
        if self in followers(patcher) and self.originals:
            self.float_layers_off_gpu()

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
            self.quantized.side_paths.to(self.offload_device)

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
                if base_of(parent._modules.get(attribute)) is quantized:
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


def install_quantized(patcher, quantized: QuantizedSet, layers: dict, float_size: int | None = None) -> None:
    """`quantized`'s layers installed on `patcher` as object patches (`layers`: {name: the layer this patcher runs, the
    set's own or a copy baked for it}; LoRA side paths where its patches need them), with the activations of the MLPs
    whose two fp8 GEMMs run as one fused pair (quantization/gelu_fusion.py), the LoRA router and the device follower;
    its size as ComfyUI reads it (ModelPatcher.size) becomes the quantized model's. `float_size`: the checkpoint's float
    size where `patcher` already reports a quantized one (a re-install)."""
    float_size = patcher.model_size() if float_size is None else float_size
    tree = patcher.model.diffusion_model
    originals = {name: tree.get_submodule(name) for name in layers}
    originals = {name: module for name, module in originals.items() if not is_quantized(module)}
    for name, layer in layers.items():
        patcher.add_object_patch(PREFIX + name, layer)
    place_side_paths(patcher, quantized.side_paths, layers)
    fused = gelu_fusion.fuse(tree, {name: patcher.object_patches[PREFIX + name] for name in layers},
                             compute_dtype(patcher))
    for name, cls in fused.items():
        patcher.add_object_patch(f"{PREFIX}{name}{CLASS_PATCH}", cls)
    if fused:
        log.info("Overdrive quantization: %d MLP(s) run their first fp8 GEMM, tanh-GELU and the second GEMM's input "
                 "cast %s.", gelu_fusion.mlp_count(fused),
                 fp8_gemm_gelu_runs_as(patcher.load_device))
    router = QuantizedPatchRouter(quantized)
    router.guard(patcher)
    follower = QuantizedModules(quantized, layers, originals, patcher.load_device, patcher.offload_device, tree,
                                patcher.model, file_weights.source_file(patcher), patcher.backup)
    follower.float_size = float_size
    for kind, callback in ((CallbacksMP.ON_CLONE, router.on_clone), (CallbacksMP.ON_DETACH, follower.on_detach),
                           (CallbacksMP.ON_CLEANUP, follower.on_cleanup), (CallbacksMP.ON_LOAD, follower.on_load),
                           (CallbacksMP.ON_REGISTER_ALL_HOOK_PATCHES, router.on_hook_patches)):
        patcher.remove_callbacks_with_key(kind, ROUTER_KEY)
        patcher.add_callback_with_key(kind, ROUTER_KEY, callback)
    patcher.remove_wrappers_with_key(WrappersMP.PREPARE_SAMPLING, ACTIVATIONS_KEY)
    patcher.add_wrapper_with_key(WrappersMP.PREPARE_SAMPLING, ACTIVATIONS_KEY, record_activations)
    patcher.set_model_patch(follower, FOLLOWER)
    # ComfyUI loads a model whole (model.to(device), every tensor) only where its size fits; told the float size, it
    # loaded a 4-bit Wan 14B that fits a short card partially, leaving the blocks' own modulation tensors in host
    # memory, which kept every compiled block off CUDA graphs.
    patcher.size = resident_bytes(patcher)


def is_quantized(module) -> bool:
    """A layer Quantize Model made (or its LoRA side path)."""
    return hasattr(module, "load_float_weight") or isinstance(module, LowRankSidePath)


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


def requantize_onto(patcher, diffusion_model) -> list:
    """SwitchWeights on a quantized model: the same layers, the same format and scales rule, quantized again from
    `diffusion_model`'s weights (the new checkpoint's), without re-measuring. New layers, so the model that was
    running keeps its own; its LoRAs run beside them as before. Returns the names of the layers re-quantized."""
    old = quantized_modules(patcher)
    if not old:
        return []
    state = {}
    for name in old:  # each layer's float weights, dequantized where the new checkpoint stores the layer in low bits
        layer = diffusion_model.get_submodule(name)
        state[f"{name}.weight"], state[f"{name}.bias"] = float_weight(layer), layer.bias
    fresh = requantize(old, state, copy=True)
    previous = quantized_set_of(patcher)
    switched = QuantizedSet(fresh, previous.report, SidePaths(fresh, previous.side_paths.dtype),
                            context=previous.context)
    reinstall(patcher, switched, fresh)
    return sorted(fresh)


def retarget(patcher) -> int:
    """After `patcher`'s model was made anew (Compile Model's classic copy, comfy_host/dynamic_vram.py): the same quantized
    layers installed over the new module tree, whose float layers they now stand in for. Returns how many."""
    layers = quantized_modules(patcher)
    if layers:
        reinstall(patcher, quantized_set_of(patcher), layers)
    return len(layers)


def reinstall(patcher, quantized: QuantizedSet, layers: dict) -> None:
    """`layers` of `quantized` installed on `patcher` in place of the quantized layers it has (their follower dropped),
    its float size carried over."""
    old = followers(patcher)
    float_size = old[0].float_size if old else None
    patcher.model_options["transformer_options"]["patches"][FOLLOWER] = []
    install_quantized(patcher, quantized, layers, float_size)


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
"""Where a quantized model's 8-bit layers and the float layers they replace live as ComfyUI loads, detaches and
unloads the model (QuantizedModules, a model patch its clones share), and the hook that brings the float layers back
for a float clone of the same checkpoint."""
import logging
import weakref

import torch

from ..core.errors import error_line
from ..quantization import gelu_fusion
from ..quantization.low_rank import base_of
from . import file_weights
from .load_state import forget_load_state
from .quantized_lora import PREFIX
from .quantized_sets import QuantizedSet
from .quantized_state import followers
from .layer_tensors import tensor_bytes
from .quantized_streaming import place
from .gpu_budget import ACTIVATIONS_BYTES, describe_room, room_for_weights
from .working_memory import MeasuredWorkingMemory

log = logging.getLogger("overdrive.quantization")
CLASS_PATCH = ".__class__"  # the key suffix of the object patches that give the fused MLPs' modules their classes
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
        self.working_memory = MeasuredWorkingMemory()  # what completed sampling runs of each kind used
        self.sampling_key = None  # this sampling's kind (record_activations), working_memory's key
        self.cache_freed = None  # bytes of ComfyUI's dynamic-VRAM cache freed at the last placing (None: no cache)
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
        streamed_before, self.streamed_bytes = self.streamed_bytes, 0
        self.quantized.side_paths.to(device)
        if self.tree is None or device.type != "cuda":
            move(self.modules.values(), device)
        else:
            kept, workspace = self.kept_free()
            try:
                streamed = place(self.tree, self.modules, device, self.streaming, self.streaming.home.bring,
                                 self.free_cache(device), kept, workspace)
            except torch.OutOfMemoryError:
                if not self.working_memory.refuse(self.sampling_key):
                    raise
                log.warning("Overdrive quantization: placing the quantized layers by the working memory a run measured "
                            "ran out of GPU memory; placed by ComfyUI's estimate instead, for this kind of sampling "
                            "from now on.")
                torch.cuda.empty_cache()
                kept, workspace = self.kept_free()
                streamed = place(self.tree, self.modules, device, self.streaming, self.streaming.home.bring,
                                 self.free_cache(device), kept, workspace)
            if streamed:
                self.streamed_bytes = streamed
                log.info("Overdrive quantization: the card's budget leaves no room for every quantized layer; %.2f GiB "
                         "of them stay in pinned host memory and are copied in block by block at each model call "
                         "(after placing: %s; a compiled model's working memory %.2f GiB; %s).", streamed / 2**30,
                         describe_room(device, kept), workspace / 2**30,
                         "no dynamic-VRAM cache of this model" if self.cache_freed is None else
                         f"{self.cache_freed / 2**30:.2f} GiB of its dynamic-VRAM cache freed")
            elif streamed_before:
                log.info("Overdrive quantization: every quantized layer fits the card now, none streams (kept free "
                         "for a model call: %.2f GiB, %s).", kept / 2**30,
                         "measured" if self.working_memory.reserve(self.sampling_key) else "ComfyUI's estimate")
        return self

    def kept_free(self) -> tuple:
        """(bytes kept free for a model call, more kept where layers stream) at placing: what a completed run of this
        sampling's kind measured, with its margin, else ComfyUI's estimate and the compiled floor; at least
        ACTIVATIONS_BYTES either way."""
        if (reserve := self.working_memory.reserve(self.sampling_key)) is not None:
            return max(ACTIVATIONS_BYTES, reserve), 0
        return max(ACTIVATIONS_BYTES, self.activations_bytes), self.workspace_bytes

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
        if vbar is None:
            self.cache_freed = None
            return None

        def free(wanted: int) -> int:
            freed = vbar.free_memory(wanted)
            self.cache_freed = (self.cache_freed or 0) + (freed or 0)
            return freed
        self.cache_freed = 0
        return free

    def on_detach(self, patcher, unpatch_all) -> None:
        if unpatch_all and self in followers(patcher) and self.offload_device is not None:
            send_home(self.quantized, self.modules.values(), self.offload_device)

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
    originals, homes, follower_ref, owner = follower.originals, follower.homes, weakref.ref(follower), follower.owner
    name, original = next(iter(originals.items()))  # ComfyUI swaps object patches all together: one tells
    handle = None

    def hook(tree, args):
        if tree.get_submodule(name) is not original:
            return  # the quantized model (or another) runs: nothing to bring back
        for layer_name, layer in originals.items():
            if layer_name in homes:
                move([layer], homes[layer_name])
        x = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        if x is not None and x.device.type == "cuda":
            place_stranded([layer for layer in originals.values() if on_device(layer) == FLOAT_HOME], x,
                           owner() if owner is not None else None)
        handle.remove()
        live = follower_ref()
        if live is not None:
            live.return_hook = None
    handle = follower.tree.register_forward_pre_hook(hook)
    return handle


def place_stranded(layers, x: torch.Tensor, base_model=None) -> None:
    """Float layers on the host that a float clone is about to run uncast on `x`'s device: ComfyUI's classic loader
    counts them loaded where it loaded the quantized model whole while they were out of the tree, and the clone reuses
    that load without moving a weight (their first call failed "mat1 is on cuda:0, different from other tensors on
    cpu"). Each goes to the card while its budget has room beside the call's activations (ComfyUI's estimate for `x`,
    from `base_model`), else casts its weights at each call, as ComfyUI's low-VRAM load makes a layer it leaves on the
    host; the model is then marked low-VRAM, so that ComfyUI's unload undoes that as it undoes its own."""
    stranded = [layer for layer in layers
                if any(getattr(sub, "comfy_cast_weights", False) is False for sub in layer.modules() if sub._parameters)]
    if not stranded:
        return
    device, activations = x.device, ACTIVATIONS_BYTES
    try:
        activations = max(activations, int(base_model.memory_required(x.shape)))
    except Exception:  # noqa: BLE001 - no estimate (not ComfyUI's model): the floor stands
        pass
    room, moved, cast = room_for_weights(device, activations), 0, 0
    for layer in stranded:
        size = tensor_bytes(layer)
        if room is None or size <= room:
            layer.to(device)
            moved += size
            room = None if room is None else room - size
            continue
        for sub in layer.modules():
            if getattr(sub, "comfy_cast_weights", None) is False:
                sub.prev_comfy_cast_weights, sub.comfy_cast_weights = False, True
                cast += 1
    if cast and base_model is not None:
        base_model.model_lowvram = True
    log.info("Overdrive quantization: a float clone runs on the load of the quantized model: %.2f GiB of the float "
             "layers it had sent to the host brought back to the GPU%s.", moved / 2**30,
             f", {cast} layer(s) cast from the host at each call (no room on the card)" if cast else "")


def on_device(module) -> torch.device | None:
    """The device of `module`'s first tensor (a layer moves as a whole). Read from the tensor dicts: `state_dict()`
    per layer, over a model's hundreds of layers, showed at every sampling run."""
    for layer in module.modules():
        for tensors in (layer._parameters, layer._buffers):
            for tensor in tensors.values():
                if tensor is not None:
                    return tensor.device
    return None


def send_home(quantized: QuantizedSet, modules, offload_device: torch.device) -> None:
    """`modules` (layers of `quantized`, or copies baked for one clone) unloaded: copied into their page-locked home,
    allocated once (comfy_host/pinned_home.py), where the offload device is the host."""
    quantized.streaming.stop()
    modules = list(modules)
    if offload_device.type == "cpu":
        try:
            quantized.streaming.home.send(modules)
        except Exception as error:  # an unload must not fail ComfyUI's memory management: moved as before
            log.warning("Overdrive quantization: the quantized layers' page-locked home failed (%s); they are copied "
                        "to pageable host memory instead.", error_line(error))
    move(modules, offload_device)  # what the home did not take
    quantized.side_paths.to(offload_device)


def home_when_unfollowed(follower: QuantizedModules) -> None:
    """When `follower` goes and no other clone runs its set's layers: those on the GPU go home, as an unload sends
    them. A clone ComfyUI drops while loaded (or whose unload went through a patcher without this follower) would
    otherwise leave them on the card, held by the set (quantized_sets.py keeps it as long as the file's model) and out
    of ComfyUI's sight."""
    quantized, offload_device = follower.quantized, follower.offload_device
    quantized.live_followers.add(follower)
    if offload_device is not None:
        finalizer = weakref.finalize(follower, _home_if_unfollowed, weakref.ref(quantized), offload_device)
        finalizer.atexit = False


def _home_if_unfollowed(quantized_ref, offload_device) -> None:
    quantized = quantized_ref()
    if quantized is None or any(True for _ in quantized.live_followers):
        return
    try:
        send_gpu_layers_home(quantized, offload_device)
    except Exception as error:  # noqa: BLE001 - a finalizer must not raise
        log.warning("Overdrive quantization: moving the quantized layers of a dropped model off the GPU failed "
                    "(%s).", error_line(error))


def send_gpu_layers_home(quantized: QuantizedSet, offload_device) -> None:
    on_gpu = [layer for layer in quantized.layers.values() if getattr(on_device(layer), "type", None) == "cuda"]
    if on_gpu:
        send_home(quantized, on_gpu, offload_device)


def home_unless_loaded(quantized: QuantizedSet, offload_device) -> None:
    """`quantized`'s layers on a GPU sent home where no model ComfyUI has loaded runs them. Quantize Model leaves them
    on the card for its model's load (quantized_model.waiting_place); a switch before that load (its copies would sit
    beside them) or a Quantize Model that fails after making them would leave them there, out of ComfyUI's sight."""
    import comfy.model_management
    for loaded in comfy.model_management.current_loaded_models:
        patcher = loaded.model
        if patcher is not None and any(follower.quantized is quantized for follower in followers(patcher)):
            return
    send_gpu_layers_home(quantized, offload_device)


def move(modules, device) -> None:
    """`module.to(device)` for each module not already there."""
    for module in modules:
        current = on_device(module)
        if current is not None and current != torch.device(device):
            module.to(device)

"""Weight patches (LoRA) on a model's quantized layers: the ones a side path runs beside a layer are routed there
(comfy_host/quantized_lora.py), added before or after Quantize Model; one that is not low-rank is baked into a copy of
the layer where Quantize Model sees it, and refused with a clear error after it."""
import copy
import logging
import uuid
import weakref

import torch

import comfy.lora
import comfy.utils

from ..quantization import gelu_fusion
from ..quantization.linear_layers import dequantized
from ..quantization.low_rank import layer_shape
from .quantized_lora import HOOK_PATCHES, PREFIX, NotLowRank, bias_key, place_side_paths, term_of, weight_key
from .quantized_sets import QuantizedSet
from .quantized_state import quantized_modules, resident_bytes

log = logging.getLogger("overdrive.quantization")


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
        # The patcher through a weak reference: this function is one of its attributes, and a cycle through it would
        # keep a dropped model's weights until Python's cycle collector runs.
        add_patches, layers, patcher_ref = type(patcher).add_patches, self.quantized.layers, weakref.ref(patcher)

        def routed_add_patches(patches, strength_patch=1.0, strength_model=1.0):
            patcher = patcher_ref()
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
        if hasattr(source, HOOK_PATCHES):  # ComfyUI's clones copy their hook patches; these are some of them
            setattr(clone, HOOK_PATCHES, dict(getattr(source, HOOK_PATCHES)))

    def on_hook_patches(self, patcher, hooks, target_dict, model_options, registered) -> None:
        """ON_REGISTER_ALL_HOOK_PATCHES, before ComfyUI loads the model to sample: the hook LoRAs' patches on quantized
        layers leave ComfyUI's hook patches (it would patch weights the 8-bit layers do not have, warning at every
        conditioning) for HOOK_PATCHES, and the side paths are placed at a rank for them all (quantized_lora.py). A
        patch no side path runs is dropped with one warning: a hook cannot stop the sampling."""
        layers = self.quantized.layers
        keys = {weight_key(name): name for name in layers}
        keys.update({bias_key(name): name for name in layers})
        before = getattr(patcher, HOOK_PATCHES, {})
        kept = {ref: moved for ref, moved in before.items() if any(hook.hook_ref == ref for hook in registered.hooks)}
        dropped = []
        for ref, patches in patcher.hook_patches.items():
            for key in [key for key in patches if key in keys]:
                name = keys[key]
                try:
                    if quantized_modules(patcher).get(name) is not layers[name]:
                        raise NotLowRank(f"{key}: a layer baked with this model's patches (no side path)")
                    if key != weight_key(name):
                        raise NotLowRank(f"{key}: a bias patch")
                    for patch in patches[key]:
                        term_of(patch, key, layer_shape(layers[name]))
                    kept.setdefault(ref, {})[key] = patches.pop(key)
                except NotLowRank:
                    del patches[key]
                    dropped.append(key)
        setattr(patcher, HOOK_PATCHES, kept)
        if dropped and not getattr(patcher, "_overdrive_hooks_warned", False):
            patcher._overdrive_hooks_warned = True
            log.warning("Overdrive quantization: a hook LoRA (scheduled on conditioning) has %d patch(es) on quantized "
                        "layers that no side path runs (not low-rank, or on a layer baked for this model: %s...): "
                        "those layers run without them. Load that LoRA with a LoRA loader before Quantize Model "
                        "instead.", len(dropped), dropped[0])
        if any(kept.values()) or any(before.values()):  # side paths for the hooks now, or none for hooks gone
            place_quantized(patcher, self.quantized)


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

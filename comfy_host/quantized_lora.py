"""LoRAs on Quantize Model's layers, run beside them as low-rank side paths (quantization/low_rank.py).

ComfyUI keeps a LoRA as weight patches on the patcher (`patcher.patches`, one entry per LoRA per weight). On the layers
that Quantize Model replaced, ComfyUI cannot apply them (an 8-bit layer has no float weight to patch), and re-quantizing
the patched weights at each change of strength cost as much as the first Quantize Model. So those patches stay on the
patcher, untouched, and at the start of each sampling run their low-rank factors and strengths are written into side
paths shared by every clone of the quantized model (`SidePaths`): a strength change rewrites a few numbers per layer, a
LoRA of another file its factors, and neither compiles, calibrates nor quantizes again.

A patch that is not low-rank (LoHa, LoKr, DoRA, a full weight difference, a bias patch, a weight function) is baked
into a copy of its layer where Quantize Model sees it, and refused with a clear error after Quantize Model.

Hook LoRAs (a LoRA scheduled on conditioning: Create Hook LoRA, then a conditioning's hooks) run beside the layers too:
their patches on quantized layers move from the patcher's hook patches to HOOK_PATCHES when ComfyUI registers them
(quantized_patch_routing.py), the side paths hold every registered hook's factors, and each time ComfyUI applies a
hook group (per conditioning, per keyframe) only the strengths are written: the hooks of the group at their keyframe
strength, the others at 0.
"""
import dataclasses
import functools
import logging
import uuid

import torch
from comfy.patcher_extension import CallbacksMP

from ..core.errors import OverdriveError
from ..quantization.low_rank import LowRankSidePath, LowRankTerm, layer_shape, rank_bucket, total_rank

log = logging.getLogger("overdrive.quantization")
PREFIX = "diffusion_model."
WRITE_KEY = "overdrive_low_rank"  # the ON_PRE_RUN and ON_APPLY_HOOKS callbacks' key
HOOK_PATCHES = "overdrive_hook_patches"  # on a patcher: {hook_ref: {key: [patch]}}, its hook LoRAs on quantized layers
NOT_LOW_RANK = (
    "{key} belongs to a layer that Quantize Model (Overdrive) replaced with an 8-bit layer, and this patch ({what}) "
    "is not a low-rank LoRA, which is all such a layer can take after quantizing. Put this LoRA loader before "
    "Quantize Model: patches applied before it are baked into the quantized weights."
)


class NotLowRank(OverdriveError, ValueError):
    """A weight patch that no low-rank side path represents; the message names the key and the fix."""


def weight_key(name: str) -> str:
    return f"{PREFIX}{name}.weight"


def bias_key(name: str) -> str:
    return f"{PREFIX}{name}.bias"


def _adapter_factors(adapter):
    """(up, down, alpha) of a plain LoRA adapter (ComfyUI's LoRAAdapter: no mid, DoRA or reshape), else None."""
    weights = getattr(adapter, "weights", None)
    if getattr(adapter, "name", None) != "lora" or not isinstance(weights, (tuple, list)) or len(weights) < 6:
        return None
    up, down, alpha, mid, dora_scale, reshape = weights[:6]
    if mid is not None or dora_scale is not None or reshape is not None:
        return None
    return up, down, alpha


def term_of(patch, key: str, shape: tuple) -> LowRankTerm:
    """The low-rank term of one of ComfyUI's weight patches (strength, adapter, strength_model, offset, function) on a
    weight of `shape`; raises NotLowRank naming what it is."""
    strength, adapter, strength_model, offset, function = patch
    factors = _adapter_factors(adapter)
    if factors is None:
        what = getattr(adapter, "name", None) or (adapter[0] if isinstance(adapter, tuple) and adapter else "diff")
        raise NotLowRank(NOT_LOW_RANK.format(key=key, what=f"a {what} patch"))
    if function is not None or strength_model != 1.0:
        raise NotLowRank(NOT_LOW_RANK.format(key=key, what="a LoRA with a weight function or a model strength"))
    if offset is not None and offset[0] != 0:
        raise NotLowRank(NOT_LOW_RANK.format(key=key, what=f"a LoRA on a slice of input dimension {offset[0]}"))
    up, down, alpha = factors
    up, down = up.flatten(1), down.flatten(1)
    scale = 1.0 if alpha is None else float(alpha) / down.shape[0]
    rows = None if offset is None else (int(offset[1]), int(offset[2]))
    if up.shape[0] != (rows[1] if rows else shape[0]) or down.shape[1] != shape[1]:
        raise NotLowRank(NOT_LOW_RANK.format(key=key, what=f"a LoRA of shapes {tuple(up.shape)} x {tuple(down.shape)} "
                                                          f"for a {shape[0]} x {shape[1]} layer"))
    return LowRankTerm(up, down, float(strength) * scale, rows)


def terms_of(patcher, layers: dict, hooks=None) -> dict:
    """{layer name: [LowRankTerm]} of `patcher`'s weight patches on `layers` ({name: quantized layer}), for the layers
    that have any, then those of its hook LoRAs (HOOK_PATCHES) at their strength in `hooks` (the HookGroup ComfyUI
    applies now) and 0 outside it; raises NotLowRank at the first patch that is not low-rank."""
    terms = {}
    registered = getattr(patcher, HOOK_PATCHES, {})
    active = {hook.hook_ref: hook.strength for hook in hooks.hooks} if hooks is not None else {}
    for name, layer in layers.items():
        if bias_key(name) in patcher.patches:
            raise NotLowRank(NOT_LOW_RANK.format(key=bias_key(name), what="a bias patch"))
        key, shape = weight_key(name), layer_shape(layer)
        layer_terms = [term_of(patch, key, shape) for patch in patcher.patches.get(key, ())]
        for ref, patches in registered.items():
            layer_terms += [dataclasses.replace(term, strength=term.strength * active.get(ref, 0.0))
                            for term in (term_of(patch, key, shape) for patch in patches.get(key, ()))]
        if layer_terms:
            terms[name] = layer_terms
    return terms


def low_rank_layers(patcher, layers: dict) -> tuple:
    """(names of `layers` whose patches all run as side paths, names of those with a patch that does not)."""
    side, baked = [], []
    for name in layers:
        try:
            terms_of(patcher, {name: layers[name]})
            side.append(name)
        except NotLowRank:
            baked.append(name)
    return side, baked


class SidePaths:
    """The side paths of one quantized model (`layers`: {name: quantized layer}), one set per rank bucket, shared by
    the clones that run it; the terms of one patcher are written in them at a time (ComfyUI samples one model at a
    time). Strength changes rewrite only the scales."""

    def __init__(self, layers: dict, dtype: torch.dtype):
        self.layers, self.dtype = layers, dtype
        self.by_rank: dict = {}  # rank -> {name: LowRankSidePath}
        self.written: dict = {}  # rank -> {name: [LowRankTerm]} written last
        self.patches_uuid = None  # the weight-patch identity of its clones that patch no weight (unpatched_uuid)

    def at_rank(self, rank: int) -> dict:
        """{name: side path} of every layer at `rank` (made on first use, beside each layer)."""
        if rank not in self.by_rank:
            self.by_rank[rank] = {name: LowRankSidePath(layer, rank, self.dtype)
                                  for name, layer in self.layers.items()}
            log.info("Overdrive quantization: LoRA side paths of rank %d beside %d quantized layers (%.0f MiB).", rank,
                     len(self.layers), self.bytes(rank) / 2**20)
        return self.by_rank[rank]

    def bytes(self, rank: int) -> int:
        return sum(t.numel() * t.element_size() for path in self.by_rank.get(rank, {}).values()
                   for t in (path.down, path.up, path.scale))

    def unpatched_uuid(self, patcher):
        """The weight-patch identity of this set's clones whose LoRAs all run beside the layers: that of the
        unpatched model `patcher` descends from (ComfyUI then reloads nothing between it and them either, as before
        any LoRA), else a new one."""
        if self.patches_uuid is None:
            source = patcher
            while source is not None and not unpatched(source):
                source = source.parent
            self.patches_uuid = source.patches_uuid if source is not None else uuid.uuid4()
        return self.patches_uuid

    def to(self, device) -> None:
        """Every side path's own buffers onto `device` (their layers move with the model)."""
        for paths in self.by_rank.values():
            for path in paths.values():
                path.buffers_to(device)

    def write(self, rank: int, terms: dict) -> str:
        """`terms` ({name: [LowRankTerm]}) into the side paths of `rank`; "" when they are written already, else what
        was written ("strengths" or "factors")."""
        paths, previous = self.at_rank(rank), self.written.get(rank)
        if previous is not None and _same_factors(previous, terms):
            if all(_strengths(previous[name]) == _strengths(terms[name]) for name in terms):
                return ""
            for name, layer_terms in terms.items():
                paths[name].write_strengths([(t.rank, t.strength) for t in layer_terms])
            self.written[rank] = terms
            return "strengths"
        for name, path in paths.items():
            if name in terms or previous is None or name in previous:
                path.write(terms.get(name, []))
        self.written[rank] = terms
        return "factors"


def _strengths(terms) -> list:
    return [term.strength for term in terms]


def _same_factors(a: dict, b: dict) -> bool:
    """The same layers with the same factor tensors (by storage: ComfyUI's LoraLoader keeps a loaded file's tensors, and
    the terms written last keep theirs alive, so an address is not reused) and slices."""
    return a.keys() == b.keys() and all(
        len(a[name]) == len(b[name]) and all(_same_tensor(x.up, y.up) and _same_tensor(x.down, y.down) and
                                             x.rows == y.rows for x, y in zip(a[name], b[name])) for name in a)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def needed_rank(terms: dict) -> int:
    """The side paths' rank bucket for `terms` (0: no side path)."""
    rank = max((total_rank(layer_terms) for layer_terms in terms.values()), default=0)
    return rank_bucket(rank) if rank else 0


def place_side_paths(patcher, side_paths: SidePaths, layers: dict) -> int:
    """`patcher`'s object patches for `layers` ({name: the layer it runs there}): where any of its LoRAs needs a side
    path, every shared layer runs beside one of the rank they need (zero rows where a layer has no LoRA: one compiled
    graph then serves every LoRA of that rank, whichever layers it patches); without LoRAs, the layers themselves. A
    layer baked for this patcher (not one of `side_paths`' layers) keeps its own object patch. Returns the rank (0:
    none)."""
    shared = {name: layer for name, layer in layers.items() if side_paths.layers.get(name) is layer}
    rank = needed_rank(terms_of(patcher, shared))
    paths = side_paths.at_rank(rank) if rank else {}
    for name in shared:
        patcher.add_object_patch(PREFIX + name, paths.get(name, shared[name]))
    for kind in (CallbacksMP.ON_PRE_RUN, CallbacksMP.ON_APPLY_HOOKS):
        patcher.remove_callbacks_with_key(kind, WRITE_KEY)
        if rank:
            patcher.add_callback_with_key(kind, WRITE_KEY, functools.partial(write_terms, side_paths))
    if not patches_weights(patcher, layers):
        # ComfyUI reloads a model whose patches_uuid differs from the one loaded (moving the whole tree to the host and
        # back, 8-bit layers and all, so their CUDA graphs are recorded again); these clones' LoRAs change no weight it
        # patches, so they all share one identity and a strength or LoRA change only writes the side paths.
        patcher.patches_uuid = side_paths.unpatched_uuid(patcher)
    return rank


def patches_weights(patcher, layers: dict) -> bool:
    """Whether ComfyUI's load patches or casts any weight of `patcher`'s model: a patch outside `layers` (the
    quantized layers it runs, whose patches run beside them or were baked into them), a weight wrapper or a cast."""
    ours = {key for name in layers for key in (weight_key(name), bias_key(name))}
    return bool(patcher.weight_wrapper_patches) or patcher.force_cast_weights or \
        any(key not in ours for key in patcher.patches)


def unpatched(patcher) -> bool:
    return not (patcher.patches or patcher.weight_wrapper_patches or patcher.force_cast_weights)


def side_paths_of(patcher) -> dict:
    """{name: LowRankSidePath} among `patcher`'s object patches."""
    return {key[len(PREFIX):]: value for key, value in patcher.object_patches.items()
            if key.startswith(PREFIX) and isinstance(value, LowRankSidePath)}


def write_terms(side_paths: SidePaths, patcher, *applied) -> None:
    """ON_PRE_RUN, and ON_APPLY_HOOKS with the hook group ComfyUI applies: this patcher's LoRA terms into the side paths
    it runs (nothing when they are there already)."""
    paths = side_paths_of(patcher)
    if not paths:
        return
    hooks = applied[0] if applied else patcher.current_hooks
    terms = terms_of(patcher, {name: path.base for name, path in paths.items()}, hooks)
    what = side_paths.write(next(iter(paths.values())).rank, terms)
    if what:  # a hook group's strengths are written at each conditioning and keyframe change: said at debug level
        log.log(logging.DEBUG if applied else logging.INFO, "Overdrive quantization: LoRA %s written beside %d "
                "quantized layers (no recompile, no re-quantization).", what, len(terms))

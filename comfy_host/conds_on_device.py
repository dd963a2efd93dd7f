"""Sampling with the conditioning moved to the GPU once, for models that carry an Overdrive forward.

ComfyUI keeps the text encoders' outputs in CPU memory and copies them to the GPU at every model call, from pageable
memory (comfy.model_base: cast_to_device of the context and every extra cond). Such a copy makes the host wait until
the GPU has run all it was given, so the host cannot queue the next step while the GPU runs this one: on Flux, three
waits a step, and a reused step of the step cache, which is short on the GPU, costs its full host time. Moved once
per sampling, the model's conds are already where the model runs; the values are the same.
"""
import copy

import torch
from comfy.patcher_extension import WrappersMP

KEY = "overdrive_conds_on_device"


def add(model) -> None:
    """Install the wrapper on ModelPatcher `model` (once, whatever the number of Overdrive nodes on it)."""
    remove(model)
    model.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, KEY, sample_with_conds_on_device)


def remove(model) -> None:
    model.remove_wrappers_with_key(WrappersMP.SAMPLER_SAMPLE, KEY)


def sample_with_conds_on_device(executor, guider, sigmas, *args, **kwargs):
    """A SAMPLER_SAMPLE wrapper: the guider's processed conds (this sampling's own copies) are swapped for copies whose
    model conds live on the sampling device, and put back afterwards for ComfyUI's cleanup."""
    original = guider.conds
    if isinstance(original, dict):
        guider.conds = {name: [cond_on(entry, sigmas.device) for entry in entries]
                        for name, entries in original.items()}
    try:
        return executor(guider, sigmas, *args, **kwargs)
    finally:
        guider.conds = original


def cond_on(entry, device):
    """One cond entry (a dict) with its model conds' tensors on `device`; the entry itself is not changed."""
    model_conds = entry.get("model_conds") if isinstance(entry, dict) else None
    if not model_conds:
        return entry
    moved = dict(entry)
    moved["model_conds"] = {name: model_cond_on(value, device) for name, value in model_conds.items()}
    return moved


def model_cond_on(value, device):
    """A comfy.conds object (CONDRegular, CONDList, ...) holding a tensor or a list of tensors, copied onto `device`;
    anything else (CONDConstant's plain values) as it is."""
    held = getattr(value, "cond", None)
    if isinstance(held, torch.Tensor):
        moved = held.to(device)
    elif isinstance(held, list) and held and all(isinstance(t, torch.Tensor) for t in held):
        moved = [t.to(device) for t in held]
    else:
        return value
    out = copy.copy(value)
    out.cond = moved
    return out

"""`quantize_module(model, config, calibration=..., filter_fn=None)` and its non-mutating half `plan_quantization`.

`plan_quantization` never touches the model: it returns the replacement modules `{qualified_name: module}` and
the report (for ComfyUI, where they become ModelPatcher object patches on a shared model). `quantize_module` applies a
plan all at once: either every chosen layer is swapped or, if anything fails, the model is left as it was.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import time

import torch
import torch.nn as nn

from . import cache as cache_mod
from . import formats
from .calibrate import Calibrator, decide
from .candidates import FilterFn, find_candidates
from .config import QuantConfig
from .gelu_fusion import fuse_in_place
from .linear_layers import stored_in_float
from .modules import build_empty, float_tensors, quantized_module_for, weight_only_module_for
from ..core.weights_ahead import on_device_ahead
from .report import QuantReport

log = logging.getLogger("overdrive.quantization")


@dataclasses.dataclass
class QuantPlan:
    modules: dict          # {qualified name: quantized replacement module}
    report: QuantReport


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its float parameters' (the 8-bit layers it holds keep their own)."""
    for tensor in model.parameters():
        if tensor.is_floating_point() and tensor.element_size() > 1:
            return tensor.dtype
    return torch.get_default_dtype()


def _as_cache(cache) -> cache_mod.QuantCache | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        return cache_mod.QuantCache()
    if isinstance(cache, cache_mod.QuantCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return cache_mod.QuantCache(cache)
    raise TypeError(f"cache={cache!r}: pass None, True (default folder), a folder path or a QuantCache.")


def _run_calibration(model, config, filter_fn, calibration) -> Calibrator:
    if isinstance(calibration, Calibrator):
        if calibration.model is not model:
            raise ValueError("calibration: this Calibrator was made for another model; make it with the model you "
                             "quantize.")
        if not calibration.recorded:
            raise ValueError("calibration: the Calibrator recorded no inputs; run the model inside "
                             "`with calibrator:` before quantizing.")
        return calibration
    if calibration is None:
        raise ValueError("calibration is needed (no cached decisions for this model and settings): pass "
                         "calibration=<a callable that runs the model for a few steps> or a Calibrator you ran.")
    if not callable(calibration):
        raise TypeError(f"calibration={calibration!r}: pass a callable that runs the model, or a Calibrator.")
    takes_model = any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      for p in inspect.signature(calibration).parameters.values())
    calibrator = Calibrator(model, config, filter_fn)
    with calibrator, torch.no_grad():
        calibration(model) if takes_model else calibration()
    if not calibrator.recorded:
        raise ValueError("calibration ran but no candidate layer was called; the callable must run this model.")
    return calibrator


def _modules_from_cache(report: QuantReport, candidates: dict, store, key, device, config,
                        store_device) -> dict | None:
    names = [layer.name for layer in report.layers]
    if sorted(names) != sorted(candidates) or any(
            candidates[n].skip_reason is not None for n in report.quantized):
        log.warning("Overdrive quantization: cached decisions %s do not match this model's layers; re-calibrating.",
                    key)
        return None
    stored = (store.load_weights(key, store_device) if report.quantized and store is not None else None) or {}
    amax = {layer.name: layer.input_amax for layer in report.layers}
    weight_only, layer_formats = set(report.weight_only), report.formats()
    # The float weights the layers are quantized again from, copied to the card one layer ahead (a checkpoint's
    # low-bit weights are made float where they are, one at a time, as before)
    from_float = [name for name in report.quantized if (name in weight_only or name not in stored)
                  and stored_in_float(candidates[name].module.weight)]
    staged, modules = set(from_float), {}
    ahead = on_device_ahead([float_tensors(candidates[name].module) for name in from_float], device)
    with contextlib.closing(ahead) as arriving:
        for name in report.quantized:  # each layer's copies referenced by its call only, gone before the next arrives
            modules[name] = _quantized_again(candidates[name], layer_formats[name], weight_only, stored.get(name),
                                             amax[name], next(arriving) if name in staged else None, device, config,
                                             store_device)
    return modules


def _quantized_again(candidate, fmt: str, weight_only: set, stored: dict | None, amax, on_device: tuple | None,
                     device, config, store_device) -> nn.Module:
    """One layer of cached decisions: int8 storage or its format quantized again from its float weight (`on_device`
    where it was copied ahead), or rebuilt from its cached quantized tensors."""
    if candidate.name in weight_only:  # int8 storage: quantized again from the float weight (rounding; no calibration)
        return weight_only_module_for(candidate.module, device, on_device).to(store_device)
    module = _from_stored(candidate, fmt, stored, config, store_device)
    if module is None:  # quantized again from the float weight: fast, and exactly what calibration built
        input_amax = None if amax is None else torch.tensor(amax, dtype=torch.float32)
        module = quantized_module_for(candidate.module, fmt, config, device=device, input_amax=input_amax,
                                      on_device=on_device).to(store_device)
    return module


def _from_stored(candidate, fmt: str, tensors: dict | None, config, store_device) -> nn.Module | None:
    """The layer rebuilt from its cached quantized tensors; None where there are none or they do not fit."""
    if tensors is None:
        return None
    try:
        module = build_empty("linear" if candidate.kind == "linear" else "conv", fmt, candidate.in_features,
                             candidate.out_features, bias=candidate.module.bias is not None, config=config,
                             device=store_device)
        module.load_quantized_state(tensors)
        return module
    except Exception as error:  # noqa: BLE001 - fall back to quantizing the float weight
        log.warning("Overdrive quantization: cached weights of %s unusable (%s); re-quantizing.", candidate.name, error)
        return None


def plan_quantization(model: nn.Module, config: QuantConfig | None = None, calibration=None,
                      filter_fn: FilterFn | None = None, *, cache=None, resolution=None, device=None,
                      weights_digest: str | None = None, between_layers=None, store_device=None,
                      decided: QuantReport | None = None) -> QuantPlan:
    """Decide per layer and build the quantized replacements, without changing `model`.

    - calibration: a callable that runs the model for a few steps (called with the model if it takes an
      argument), or a `Calibrator` you already ran. Not called when the cache has the decisions.
    - filter_fn(module, qualified_name) -> bool: False leaves that layer alone.
    - cache: None (off), True (default folder), a folder, or a `QuantCache`.
    - resolution: (h, w) or (batch, h, w) of the sampling run (or a string); part of the cache key.
    - device: where the quantized modules run (default: the model's parameters' device).
    - weights_digest: the model's weights identity if the caller already has one (skips hashing the weights).
    - between_layers: called before each layer is measured (a host's stop check, which raises to end the plan).
    - store_device: where the quantized modules are returned (default: `device`). Each goes there as soon as it is
      built, so a host that loads them later (ComfyUI) never holds the float model and every 8-bit layer together.
    - decided: another process's report for the same model and settings, taken instead of calibrating (the processes
      of a parallelize_ group run the same layers).
    """
    # Built outside inference mode (even when called inside one, as ComfyUI runs nodes): the quantized buffers are
    # then ordinary tensors that `load_float_weight` may overwrite later from any mode.
    with torch.inference_mode(False), torch.no_grad():
        if decided is not None:
            return _plan_decided(model, config, decided, filter_fn, device, store_device)
        return _plan(model, config, calibration, filter_fn, cache, resolution, device, weights_digest,
                     between_layers, store_device)


def _plan_decided(model, config, decided: QuantReport, filter_fn, device, store_device) -> QuantPlan:
    config = (config or QuantConfig()).validate()
    device = torch.device(device) if device is not None else _model_device(model)
    store_device = torch.device(store_device) if store_device is not None else device
    fmt = config.resolve_format(device)
    candidates = find_candidates(model, config, fmt if formats.get(fmt).bits >= 8 else None, filter_fn)
    modules = _modules_from_cache(decided, {c.name: c for c in candidates}, None, "another process's decisions",
                                  device, config, store_device)
    if modules is None:
        raise ValueError("quantize_: another process's decisions do not match this model's layers: every process "
                         "must quantize the same model with the same settings")
    return QuantPlan(modules, dataclasses.replace(decided, cache_hit=False, calibrated=False))


def _plan(model, config, calibration, filter_fn, cache, resolution, device, weights_digest,
          between_layers, store_device) -> QuantPlan:
    started = time.perf_counter()
    config = (config or QuantConfig()).validate()
    device = torch.device(device) if device is not None else _model_device(model)
    store_device = torch.device(store_device) if store_device is not None else device
    fmt = config.resolve_format(device)
    # Below 8 bits a layer the format's kernel cannot take falls back to 8 bits: its inputs are recorded all the same.
    candidates = find_candidates(model, config, fmt if formats.get(fmt).bits >= 8 else None, filter_fn)
    by_name = {c.name: c for c in candidates}
    store = _as_cache(cache)

    key = None
    if store is not None:
        digest = weights_digest or cache_mod.weights_digest(model)
        key = cache_mod.decision_key(digest, config.to_dict(), fmt, cache_mod.resolution_bucket(resolution),
                                     device,
                                     [[c.name, c.kind, c.skip_reason] for c in candidates])
        cached = store.load(key)
        if cached is not None:
            modules = _modules_from_cache(cached, by_name, store, key, device, config, store_device)
            if modules is not None:
                cached.cache_hit, cached.calibrated, cached.cache_key = True, False, key
                cached.seconds = {"total": time.perf_counter() - started}
                return QuantPlan(modules, cached)

    calibrator = _run_calibration(model, config, filter_fn, calibration)
    measure_started = time.perf_counter()
    decisions, modules = decide(candidates, calibrator.samples, config, fmt, between_layers, store_device)
    report = QuantReport(format=fmt, device=str(device), config=config.to_dict(), layers=decisions,
                         cache_hit=False, calibrated=True, cache_key=key)
    report.seconds = {"calibration_run": calibrator.seconds, "measure": time.perf_counter() - measure_started,
                      "total": time.perf_counter() - started}
    if store is not None:
        store.save(key, report, modules)
    return QuantPlan(modules, report)


def _parent(model: nn.Module, name: str):
    parent_name, _, attr = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        raise KeyError(f"{name!r} is not a submodule of the model") from None
    return parent, attr


def apply_modules(model: nn.Module, modules: dict) -> dict:
    """Swap `modules` into `model`, all or nothing; returns the originals {name: module} for `restore_modules`."""
    targets = {}
    for name in modules:  # resolve everything before changing anything
        parent, attr = _parent(model, name)
        if attr not in parent._modules:
            raise KeyError(f"{name!r} is not a submodule of the model")
        targets[name] = (parent, attr, parent._modules[attr])
    swapped = []
    try:
        for name, module in modules.items():
            parent, attr, _ = targets[name]
            setattr(parent, attr, module)
            swapped.append(name)
    except BaseException:
        for name in reversed(swapped):
            parent, attr, original = targets[name]
            setattr(parent, attr, original)
        raise
    return {name: original for name, (_, _, original) in targets.items()}


def restore_modules(model: nn.Module, originals: dict):
    """Undo `apply_modules`."""
    for name, module in originals.items():
        parent, attr = _parent(model, name)
        setattr(parent, attr, module)


def quantize_module(model: nn.Module, config: QuantConfig | None = None, calibration=None,
              filter_fn: FilterFn | None = None, **kwargs) -> QuantReport:
    """Quantize `model` in place, as measured (see `plan_quantization` for the arguments), with the MLPs whose two
    projections became static fp8 layers fused (quantization/gelu_fusion.py). Returns the report.

    All or nothing: if calibration, measuring or swapping fails, the error propagates and `model` is unchanged.
    """
    plan = plan_quantization(model, config, calibration, filter_fn, **kwargs)
    apply_modules(model, plan.modules)
    fused = fuse_in_place(model, plan.modules, _model_dtype(model))
    log.info("%s%s", plan.report.summary(), f"; {fused} MLP(s) run fc1, tanh-GELU and fc2's input cast as one fp8 "
                                            f"kernel" if fused else "")
    log.debug("%s", plan.report.table())
    return plan.report


"""quantize_: Overdrive's measured int8/fp8 quantization (overdrive.quantization) on a pipeline's UNet or a module."""
import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..families import family_of
from ..quantization import QuantConfig, QuantReport
from ..quantization import quantize_module
from ..quantization.candidates import keeping_float
from .installed import eager_forward, rebuild
from .targets import is_pipeline, target_modules

CALIBRATION_STEPS = 4  # sampling steps of the default calibration run: spread over the whole noise range


def quantize_(target, config: QuantConfig | None = None, calibration=None, *, cache=None, filter_fn=None,
              resolution=None) -> QuantReport:
    """Quantize in place, layer by layer where it is measured to be accurate and worth it; returns the report.

    - target: a diffusers pipeline (its UNet or DiT transformer(s) are quantized; text encoders and VAE stay as they
      are) or a module.
    - calibration: what runs the model so the layers' real inputs can be measured:
        * for a pipeline, a dict of pipeline arguments with your prompt and resolution, e.g.
          {"prompt": "a photo of a cat", "height": 1024, "width": 1024}: the pipeline runs once with them
          (num_inference_steps=4 unless given, output_type="latent", generator seeded 0 unless given);
        * a callable that runs the model (called with no arguments, or with the module if it takes one),
          e.g. lambda: pipe("a cat", num_inference_steps=4);
        * a Calibrator you already ran (overdrive.quantization.Calibrator);
        * None: only with a cache that already holds the decisions for these weights and settings.
      Calibration always runs the eager forward, even when compile_ or deepcache_ were applied before.
    - cache: None (off), True (~/.cache/overdrive/quantization or $OVERDRIVE_CACHE_DIR), a folder or a QuantCache:
      the decisions, so a later process skips calibration (QuantCache(folder, store_weights=True) also keeps the
      quantized weights).
    - filter_fn(module, qualified_name) -> bool: False (or a string, the report's reason) leaves that layer alone.
    - resolution: part of the cache key (taken from the calibration dict's height/width when not given).
    All or nothing: if anything fails, the error propagates and the model is unchanged.
    """
    denoisers = target_modules(target, "quantize_")
    # Wan 2.2 A14B's two experts are quantized as one model: one calibration run measures both (each on its own
    # steps); the report and filter_fn name their layers "transformer.…" and "transformer_2.…".
    module = denoisers[0][1] if len(denoisers) == 1 else nn.ModuleDict(dict(denoisers))
    if config is not None and not isinstance(config, QuantConfig):
        raise TypeError(f"quantize_: config must be a QuantConfig, not {type(config).__name__}; e.g. "
                        "QuantConfig(format='int8'). Nothing was changed.")
    if calibration is None and cache in (None, False):
        raise ValueError("quantize_ needs calibration: pass calibration={'prompt': ..., 'height': ..., 'width': ...} "
                         "(a pipeline; it runs a few steps), a callable that runs the model, or a Calibrator; or a "
                         "cache= that already holds the decisions. Nothing was changed.")
    if isinstance(calibration, dict):
        if not is_pipeline(target):
            raise TypeError("quantize_: a dict of pipeline arguments calibrates a pipeline; for a module pass a "
                            "callable that runs it. Nothing was changed.")
        calibration, resolution = _pipeline_run(target, calibration, resolution)
    float_layers = {(layer if len(denoisers) == 1 else rf"{name}\.{layer}"): why for name, denoiser in denoisers
                    for layer, why in getattr(family_of(denoiser), "float_layers", ())}
    with contextlib.ExitStack() as eager:
        for _, denoiser in denoisers:
            eager.enter_context(eager_forward(denoiser))
        report = _decided_once(module, config, calibration, keeping_float(float_layers, filter_fn), cache=cache,
                               resolution=resolution)
    for _, denoiser in denoisers:
        rebuild(denoiser)  # compiled graphs keyed by the 8-bit layers now in the module
    return report


def _decided_once(module, config, calibration, filter_fn, **kwargs) -> QuantReport:
    """quantize_module_, except in a torch.distributed group of several processes (parallelize_'s): process 0
    calibrates and decides, the others take its decisions, so every process runs the same layers (decisions timed on
    each would differ) and only one calibrates. Every process of the group must call it, as torchrun scripts do."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return quantize_module(module, config, calibration, filter_fn, **kwargs)
    if dist.get_rank() != 0:
        decided = [None]
        dist.broadcast_object_list(decided, src=0)
        if isinstance(decided[0], str):
            raise RuntimeError(f"quantize_: process 0 could not decide ({decided[0]}); nothing was changed")
        return quantize_module(module, config, None, filter_fn, decided=decided[0])
    try:
        report = quantize_module(module, config, calibration, filter_fn, **kwargs)
    except BaseException as error:
        dist.broadcast_object_list([f"{type(error).__name__}: {error}"], src=0)  # the others must not wait forever
        raise
    dist.broadcast_object_list([report], src=0)
    return report


def _pipeline_run(pipe, arguments: dict, resolution):
    arguments = {"num_inference_steps": CALIBRATION_STEPS, "output_type": "latent",
                 "generator": torch.Generator().manual_seed(0), **arguments}
    if resolution is None and "height" in arguments and "width" in arguments:
        resolution = (arguments["height"], arguments["width"])

    def run():
        pipe(**arguments)

    return run, resolution

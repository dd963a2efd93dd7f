"""Quantize Model on a ComfyUI ModelPatcher: the quantized layers of a model's weights (made once per weights and
settings in this process, quantized_sets.py), installed on a clone beside its LoRAs, with the report and the recipe
another process needs to quantize its own copy the same way."""
import logging
import os
import time
import uuid

import comfy.model_management
import torch

from ..attention.choice import AttentionConfig
from ..core.errors import error_line
from ..families import family_of
from ..quantization import QuantCache, QuantConfig, plan_quantization
from ..quantization.cache import weights_fingerprint
from ..quantization.candidates import keeping_float
from . import checkpoint_formats, quantized_sets
from .attention_override import install_attention
from .cache_folder import comfy_cache_dir
from .file_weights import source_file
from .forward_patch import FORWARD, installed_stack, rebuild
from .gpu_budget import ACTIVATIONS_BYTES, describe_room, room_for_weights
from .peak_memory import peak_memory
from .quantize_calibration import RECORDING_ROOM, CalibrationRun, with_room_to_calibrate
from .quantize_patches import float_view, install_quantized
from .quantized_patch_routing import bake_weight_patches
from .quantized_state import compute_dtype, quantized_set_of
from .quantized_follower import home_unless_loaded
from .quantized_lora import SidePaths, low_rank_layers, weight_key
from .quantized_sets import QuantizedSet, set_key

log = logging.getLogger("overdrive")


def quant_cache_dir() -> str:
    """Decisions: $OVERDRIVE_CACHE_DIR/quantization, else beside ComfyUI's models."""
    return str(comfy_cache_dir("quantization"))


def calibration_clone(model):
    """A clone for calibration: the weights without their LoRAs (the decisions are keyed by them, so that a LoRA or a
    strength change reuses them; a LoRA runs beside the quantized layers), every layer eager on every step (the
    calibration hooks see all the real inputs), so Compile Model's and DeepCache's forwards, if they come before this
    node, are left out of it; its loads leave room on the card for the recording (quantize_calibration.leave_room)."""
    calib = model.clone()
    calib.patches = {}
    calib.patches_uuid = uuid.uuid4()
    if installed_stack(calib) is not None:
        calib.object_patches = {k: v for k, v in calib.object_patches.items() if k != FORWARD}
    with_room_to_calibrate(calib)
    return calib


def base_tensors(model, tree) -> list:
    """(name, tensor) of the diffusion model's weights as its file has them: where ComfyUI patched one in place (a
    loaded LoRA), its backup."""
    pairs = []
    for name, tensor in (*tree.named_parameters(), *tree.named_buffers()):
        held = model.backup.get(f"diffusion_model.{name}")
        pairs.append((name, held.weight if held is not None else tensor))
    return pairs


def file_identity(model) -> str:
    """The file ComfyUI's loader read `model` from, with its size and time ("" for a model made otherwise): beside the
    weights' sampled fingerprint, two files that differ only where it does not sample are two models."""
    path = source_file(model)
    if path is None or not os.path.isfile(path):
        return ""
    stat = os.stat(path)
    return f"|{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}"


def quantized_clone(model, config: QuantConfig, run: CalibrationRun | None, attention: AttentionConfig,
                    resolution: str | None = None, folder: str | None = None):
    """(patched clone, report): the quantized layers of `model`'s weights at these settings, taken from an earlier run
    in this process where one made them (quantized_sets.py), else made: calibrated unless the cache has the decisions,
    and quantized. `model`'s LoRAs run beside them (quantized_lora.py). Without a `run` the decisions for `resolution`
    must be cached (another process's copy of a model quantized here: Parallel Model's workers), in `folder` (default:
    quant_cache_dir())."""
    started = time.perf_counter()
    context = run.cache_context() if run is not None else resolution
    fmt = config.resolve_format(model.load_device)
    tree = float_view(model)
    float_layers = dict(getattr(family_of(tree), "float_layers", ()))
    fingerprint = weights_fingerprint(base_tensors(model, tree))
    key = set_key(fingerprint + file_identity(model), config.to_dict(), fmt, model.load_device, float_layers)
    quantized = quantized_sets.live(key)
    reused = quantized is not None
    if not reused:
        quantized = quantize_once(model, config, run, attention, context, folder, fingerprint, float_layers, key)
    quantized_sets.keep(quantized, model.model.diffusion_model)
    patched = model.clone()
    layers = dict(quantized.layers)
    try:
        side, baked_names = low_rank_layers(patched, layers)
        layers.update(bake_weight_patches(patched, layers, baked_names, tree, model.load_device))
        install_quantized(patched, quantized, layers)
    except BaseException:
        home_unless_loaded(quantized, model.offload_device)  # no model follows the layers that wait on the card
        raise
    rebuild(patched)  # Compile Model / DeepCache came first: their graphs are keyed by the 8-bit layers
    beside = sum(weight_key(name) in patched.patches for name in side)
    lora = [f"LoRAs run beside {beside} quantized layer(s)"] if beside else []
    lora += [f"LoRA/weight patches baked into {len(baked_names)} quantized layer(s)"] if baked_names else []
    if reused:
        log.info("%s [the layers quantized earlier in this process for these weights and settings: no calibration, no "
                 "quantizing, %.2f s]%s", quantized.report.summary(), time.perf_counter() - started,
                 "; " + "; ".join(lora) if lora else "")
    elif lora:
        log.info("Overdrive quantization: %s.", "; ".join(lora))
    return patched, quantized.report


def quantize_once(model, config, run, attention, context, folder, fingerprint, float_layers, key) -> QuantizedSet:
    """The quantized layers of `model`'s weights without their LoRAs: calibrated unless the cache has the decisions.
    The calibration runs with Overdrive's attention, so that its shapes are measured before Compile Model traces the
    blocks (attention/e4m3_output.py)."""
    started = time.perf_counter()
    with peak_memory(model.load_device) as peak:
        calib = calibration_clone(model)
        install_attention(calib, attention)
        # Loaded, the module tree holds this model's float weights (other clones' 8-bit layers and LoRAs taken out).
        comfy.model_management.load_models_gpu([calib])
        loaded = time.perf_counter()
        diffusion = calib.model.diffusion_model
        cache = QuantCache(folder or quant_cache_dir())
        plan = plan_quantization(diffusion, config, calibration=(lambda: run(calib)) if run is not None else None,
                                 filter_fn=keeping_float(float_layers), cache=cache, resolution=context,
                                 device=model.load_device, weights_digest=fingerprint,
                                 store_device=waiting_place(calib, diffusion),
                                 between_layers=comfy.model_management.throw_exception_if_processing_interrupted)
    report = plan.report
    path = cache.decisions_path(report.cache_key)
    if report.cache_hit:
        source = f"cache hit, no calibration ({path})"
    else:
        seconds = report.seconds
        source = (f"cache miss, calibrated with {run.describe()} in {seconds.get('calibration_run', 0.0):.1f} s, "
                  f"measured in {seconds.get('measure', 0.0):.1f} s; "
                  + (f"decisions saved to {path}" if path.is_file() else "decisions not saved (see the warning)"))
    log.info("%s [%s; float model loaded in %.1f s; %.1f s in all]%s", report.summary(), source, loaded - started,
             time.perf_counter() - started, f"; GPU memory while quantizing: {peak['text']}" if peak["text"] else "")
    log.debug("%s", report.table())
    return QuantizedSet(plan.modules, report, SidePaths(plan.modules, compute_dtype(model)), key, context)


def waiting_place(calib, tree) -> torch.device:
    """Where the 8-bit layers wait from quantizing until the quantized model loads. On the card where it has room for
    all of them beside the whole float model and the calibration's working memory: copied out to the host and back in
    at the load, they took most of a cached Quantize Model's time (bench/experiments/quantize-model-time.md). Else
    where ComfyUI keeps offloaded weights: beside a float model that a short card holds only partly, they would run it
    out of memory."""
    kept_free = ACTIVATIONS_BYTES + RECORDING_ROOM
    room = room_for_weights(calib.load_device, kept_free)
    if room is None:
        return calib.offload_device
    float_to_load = calib.model_size() - calib.loaded_size()
    at_most = sum(weight.numel() for weight in tree.parameters())  # one byte a weight: no 8- or 4-bit layer takes more
    if room < float_to_load + at_most:
        return calib.offload_device
    log.info("Overdrive quantization: the quantized layers stay on the card until the quantized model loads (room for "
             "%.2f GiB beside the float model's %.2f GiB still to load; %s).", at_most / 2**30, float_to_load / 2**30,
             describe_room(calib.load_device, kept_free))
    return calib.load_device


REPORT = "overdrive_quantization_report"  # the returned model's attachment: what Quantize Model did, for callers
# and how, for another process to quantize its own copy the same way: (QuantConfig, AttentionConfig, the cached
# decisions' resolution context, their folder)
RECIPE = "overdrive_quantization_recipe"


def quantization_report(model):
    """The QuantReport of the Quantize Model run that made `model` (None where it fell back to the float model)."""
    return model.get_attachment(REPORT)


def requantized(model, recipe: tuple):
    """`model` (another process's copy of the file a model was quantized from, with the same weight patches)
    quantized as `recipe` says, with the decisions Quantize Model cached: the same layers, formats and attention."""
    config, attention, resolution, folder = recipe
    patched, _ = quantized_clone(model, config, None, attention, resolution, folder)
    install_attention(patched, attention)
    return patched


def quantize_model(model, config: QuantConfig, run: CalibrationRun, attention: AttentionConfig):
    """Quantize Model's output: a clone of `model` with its quantized layers and `attention`, its report and recipe
    attached; where quantizing fails, the float model with a warning (a generation never fails for an optimization)."""
    report = None
    stored = checkpoint_formats.report(model.model.diffusion_model)
    try:
        patched, report = quantized_clone(model, config, run, attention)
    except comfy.model_management.InterruptProcessingException:
        raise
    except Exception as error:  # noqa: BLE001 - a generation never fails because of an optimization
        log.warning("Overdrive: quantizing failed, so the model runs unquantized (your generation continues). "
                    "Reason: %s", error_line(error, 500), exc_info=log.isEnabledFor(logging.DEBUG))
        patched = model.clone()
    patched.set_attachments(REPORT, report)
    made = quantized_set_of(patched)  # the decisions' context: the first run's, where later ones reuse its layers
    patched.set_attachments(RECIPE, (config, attention, made.context, quant_cache_dir())
                            if report is not None and made is not None else None)
    checkpoint_formats.report_conversions(stored, report.formats() if report else {})
    log.info("Overdrive %s", install_attention(patched, attention))
    return patched

"""QuantizeModel: measured int8/fp8 quantization of the diffusion model, applied as ModelPatcher object patches."""
import logging
import os
import time
import uuid

import comfy.model_management
from comfy_api.latest import io

from ..attention.choice import MODES as ATTENTION_MODES
from ..attention.choice import AttentionConfig
from ..families import family_of
from ..errors import error_line
from ..quantization import QuantCache, QuantConfig, format_names, plan_quantization
from ..quantization.cache import weights_fingerprint
from ..quantization.candidates import keeping_float
from ..quantization.formats import bit_widths
from . import checkpoint_formats
from .cache_folder import comfy_cache_dir
from .attention_override import install_attention
from .forward_patch import FORWARD, installed_stack, rebuild
from .peak_memory import peak_memory
from .quantize_calibration import DEFAULT_STEPS, MAX_STEPS, CalibrationRun
from . import quantized_sets
from .file_weights import source_file
from .quantize_patches import (bake_weight_patches, compute_dtype, float_view, install_quantized,
                               quantized_set_of)
from .quantized_lora import SidePaths, low_rank_layers, weight_key
from .quantized_sets import QuantizedSet, set_key
from .schema import node_schema, patched_copy_input

log = logging.getLogger("overdrive")
DEFAULTS = QuantConfig()
ATTENTION_DEFAULTS = AttentionConfig()

TOOLTIPS = {
    "model": "LoRAs before or after this node run beside its quantized layers (a strength change quantizes nothing "
             "again); decisions are made on the weights without them.",
    "bits": "Bits per weight. 8: int8 or fp8 tensor-core kernels. 4: int4 weights (half the VRAM of 8 bits, for "
            "cards that cannot hold the model in 8 bits) computed in fp8, on GPUs with fp8; a layer whose 4-bit error "
            "is above int4_mse_threshold gets the 8-bit decision instead.",
    "format": "auto: fp8 (e4m3) on GPUs that have it (Ada, Hopper, Blackwell), int8 on Ampere and on the CPU; with "
              "bits 4, int4_fp8. int8 / fp8_e4m3 / int4_fp8: force one (its bits must match); on a GPU without it "
              "(fp8 before Ada, int8 before Ampere) an error says so. The CPU runs them through PyTorch's reference "
              "kernels: for testing, not for speed.",
    "quantize_conv": "Consider 1x1 convolutions (SD1.5's attention projections, skip connections). Other convs stay "
                     "in the model's precision (no 8-bit kernel for them).",
    "quantize_linear": "Consider linear layers (attention and feed-forward projections).",
    "conv_mse_threshold": "Largest error a conv may add to be quantized: mean squared error over output power, "
                          "measured on your calibration inputs. 0.01 = noise 20 dB below the signal; 0 quantizes none.",
    "linear_mse_threshold": "Largest error a linear layer may add to be quantized (as for convs). Lower keeps more "
                            "layers in full precision; 0 quantizes none.",
    "int4_mse_threshold": "bits 4 only: largest error a layer's 4-bit weights may add (as for linear_mse_threshold). "
                          "4 bits are for cards that do not hold the model in 8 bits, where every layer left in 8 bits "
                          "is copied in at each step: a looser bound than 8 bits' is what pays there. Lower it for "
                          "fewer 4-bit layers, 0 for none.",
    "compute_density_threshold": "FLOP per byte a layer must reach to be quantized: below it the layer is "
                                 "memory-bound: its time is reading its weight, which weight_only halves (a GPU's "
                                 "ridge point: its FLOP/s over its memory bandwidth). 0 accepts every layer whose "
                                 "error is low enough.",
    "min_speedup": "On NVIDIA GPUs each layer that passes both checks is also timed at its real shape, float against "
                   "8-bit, and quantized only if it runs at least this many times faster (1.1 = 10 % faster). fp8 "
                   "layers are timed as they run under Compile Model (their input cast fused into the layer before). "
                   "0 turns the timing off (density alone decides). Not used on the CPU.",
    "weight_only": "Layers below compute_density_threshold (memory-bound, e.g. a DiT's modulation layers) keep "
                   "their weights in int8, one scale per output channel, and compute "
                   "in the model's precision: half their VRAM, and under Compile Model half the bytes to read. Only "
                   "where their measured error is below linear_mse_threshold / conv_mse_threshold. On NVIDIA GPUs "
                   "one with 16 or more rows (a text stream) runs its 8-bit GEMM instead where that measures "
                   "min_speedup times faster. Off: they stay in float.",
    "calibration_steps": "Sampling steps of the calibration run (euler, fixed seed) that records each layer's real "
                         "inputs. 2-3 are enough. Skipped when the decisions for this model and settings are cached.",
    "positive": "Optional: your positive prompt, so calibration measures the activations of your prompt. Without "
                "it, empty (zero) conditioning is used.",
    "negative": "Optional: your negative prompt (see positive).",
    "attention": "Attention kernels on NVIDIA GPUs, chosen per shape at its first call by timing each one on that "
                 "call's inputs against PyTorch's SDPA (the log shows the figures). auto: the fastest that is at "
                 "least 3 % faster than SDPA and within attention_max_error, among the 16-bit kernels (SDPA's cuDNN "
                 "kernel, FlashAttention-3 where fa3-fwd is installed) and the 8-bit ones on Hopper and newer "
                 "(Triton int8/fp8 kernels, cuDNN's fp8 attention where nvidia-cudnn-frontend is installed). exact: "
                 "the 16-bit kernels only (what Compile Model uses). 8bit: the fastest 8-bit kernel within the bound "
                 "even if SDPA is faster. sdpa: PyTorch's SDPA as ComfyUI calls it. Masked attention and other "
                 "nodes' attention overrides always use ComfyUI's own attention.",
    "attention_max_error": "Largest relative error per attention call an 8-bit kernel may add, measured against "
                           "SDPA on the same inputs (0.05 = 5 %). cuDNN's fp8 attention adds the most of them; "
                           "lower the bound to keep it out (bench/README.md has the measured errors).",
    "latent": "Optional: your latent (e.g. Empty Latent Image), so calibration runs at your resolution and batch. "
              "Without it, the model's natural resolution (SD1.5 512², SDXL 1024²) is used.",
}


def quant_cache_dir() -> str:
    """Decisions: $OVERDRIVE_CACHE_DIR/quantization, else beside ComfyUI's models."""
    return str(comfy_cache_dir("quantization"))


def calibration_clone(model):
    """A clone for calibration: the weights without their LoRAs (the decisions are keyed by them, so that a LoRA or a
    strength change reuses them; a LoRA runs beside the quantized layers), every layer eager on every step (the
    calibration hooks see all the real inputs), so Compile Model's and DeepCache's forwards, if they come before this
    node, are left out of it."""
    calib = model.clone()
    calib.patches = {}
    calib.patches_uuid = uuid.uuid4()
    if installed_stack(calib) is not None:
        calib.object_patches = {k: v for k, v in calib.object_patches.items() if k != FORWARD}
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
        quantized = quantized_sets.keep(quantize_once(model, config, run, attention, context, folder, fingerprint,
                                                      float_layers, key))
    patched = model.clone()
    layers = dict(quantized.layers)
    side, baked_names = low_rank_layers(patched, layers)
    layers.update(bake_weight_patches(patched, layers, baked_names, tree, model.load_device))
    install_quantized(patched, quantized, layers)
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
        # The 8-bit layers wait where ComfyUI keeps offloaded weights until the quantized model loads: beside a float
        # model that a short card holds only partly, they would run it out of memory.
        plan = plan_quantization(diffusion, config, calibration=(lambda: run(calib)) if run is not None else None,
                                 filter_fn=keeping_float(float_layers), cache=cache, resolution=context,
                                 device=model.load_device, weights_digest=fingerprint,
                                 store_device=model.offload_device,
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


class OverdriveQuantizeModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        threshold = {"min": 0.0, "max": 1000.0, "step": 0.001}
        return node_schema(
            "OverdriveQuantizeModel", "Quantize Model (Overdrive)",
            ("Runs the diffusion model's compute-heavy linear and 1x1-conv layers with int8 or fp8 kernels (or int4 "
             "weights in fp8 where memory is short). A short calibration run measures each layer's error on real "
             "inputs; only layers below the error threshold and dense enough to gain are quantized (the log lists every"
             " decision). Decisions are cached per model, settings, resolution and GPU, and within ComfyUI the layers "
             "serve every LoRA, strength, prompt and size; LoRAs run beside them. If quantizing fails, the model runs "
             "unquantized with a warning in the log."),
            inputs=[
                patched_copy_input(io.Model, "model", "diffusion model", "quantize", TOOLTIPS["model"]),
                io.Int.Input("bits", default=DEFAULTS.bits, min=min(bit_widths()), max=max(bit_widths()),
                             step=4, tooltip=TOOLTIPS["bits"]),
                io.Combo.Input("format", options=list(format_names()), default=DEFAULTS.format,
                               tooltip=TOOLTIPS["format"]),
                io.Boolean.Input("quantize_conv", default=DEFAULTS.quantize_conv, tooltip=TOOLTIPS["quantize_conv"]),
                io.Boolean.Input("quantize_linear", default=DEFAULTS.quantize_linear,
                                 tooltip=TOOLTIPS["quantize_linear"]),
                io.Float.Input("conv_mse_threshold", default=DEFAULTS.conv_mse_threshold, **threshold,
                               tooltip=TOOLTIPS["conv_mse_threshold"]),
                io.Float.Input("linear_mse_threshold", default=DEFAULTS.linear_mse_threshold, **threshold,
                               tooltip=TOOLTIPS["linear_mse_threshold"]),
                io.Float.Input("compute_density_threshold", default=DEFAULTS.compute_density_threshold, min=0.0,
                               max=100000.0, step=1.0, tooltip=TOOLTIPS["compute_density_threshold"]),
                io.Int.Input("calibration_steps", default=DEFAULT_STEPS, min=1, max=MAX_STEPS,
                             tooltip=TOOLTIPS["calibration_steps"]),
                io.Float.Input("int4_mse_threshold", default=DEFAULTS.int4_mse_threshold, **threshold,
                               tooltip=TOOLTIPS["int4_mse_threshold"], optional=True),
                io.Float.Input("min_speedup", default=DEFAULTS.min_speedup, min=0.0, max=10.0, step=0.05,
                               tooltip=TOOLTIPS["min_speedup"], optional=True),
                io.Boolean.Input("weight_only", default=DEFAULTS.weight_only, tooltip=TOOLTIPS["weight_only"],
                                 optional=True),
                io.Combo.Input("attention", options=list(ATTENTION_MODES), default=ATTENTION_DEFAULTS.mode,
                               tooltip=TOOLTIPS["attention"], optional=True),
                io.Float.Input("attention_max_error", default=ATTENTION_DEFAULTS.max_error, min=0.001, max=1.0,
                               step=0.001, tooltip=TOOLTIPS["attention_max_error"], optional=True),
                io.Conditioning.Input("positive", tooltip=TOOLTIPS["positive"], optional=True),
                io.Conditioning.Input("negative", tooltip=TOOLTIPS["negative"], optional=True),
                io.Latent.Input("latent", tooltip=TOOLTIPS["latent"], optional=True),
            ],
            outputs=[io.Model.Output(tooltip="The model with the chosen layers running low-bit kernels (the input "
                                             "MODEL is unchanged).")],
        )

    @classmethod
    def execute(cls, model, bits=DEFAULTS.bits, format=DEFAULTS.format, quantize_conv=DEFAULTS.quantize_conv,
                quantize_linear=DEFAULTS.quantize_linear, conv_mse_threshold=DEFAULTS.conv_mse_threshold,
                linear_mse_threshold=DEFAULTS.linear_mse_threshold,
                compute_density_threshold=DEFAULTS.compute_density_threshold, calibration_steps=DEFAULT_STEPS,
                positive=None, negative=None, latent=None, min_speedup=DEFAULTS.min_speedup,
                attention=ATTENTION_DEFAULTS.mode, attention_max_error=ATTENTION_DEFAULTS.max_error,
                weight_only=DEFAULTS.weight_only, int4_mse_threshold=DEFAULTS.int4_mse_threshold) -> io.NodeOutput:
        # Bad settings are the user's to fix: clear errors, before any work.
        config = QuantConfig(bits=bits, format=format, quantize_conv=quantize_conv, quantize_linear=quantize_linear,
                             conv_mse_threshold=conv_mse_threshold, linear_mse_threshold=linear_mse_threshold,
                             compute_density_threshold=compute_density_threshold, min_speedup=min_speedup,
                             weight_only=weight_only, int4_mse_threshold=int4_mse_threshold)
        config.resolve_format(model.load_device)
        attention_config = AttentionConfig(attention, attention_max_error)
        run = CalibrationRun.build(model, positive, negative, latent, calibration_steps)
        report = None
        stored = checkpoint_formats.report(model.model.diffusion_model)
        try:
            patched, report = quantized_clone(model, config, run, attention_config)
        except comfy.model_management.InterruptProcessingException:
            raise
        except Exception as error:  # noqa: BLE001 - a generation never fails because of an optimization
            log.warning("Overdrive: quantizing failed, so the model runs unquantized (your generation continues). "
                        "Reason: %s", error_line(error, 500), exc_info=log.isEnabledFor(logging.DEBUG))
            patched = model.clone()
        patched.set_attachments(REPORT, report)
        made = quantized_set_of(patched)  # the decisions' context: the first run's, where later ones reuse its layers
        patched.set_attachments(RECIPE, (config, attention_config, made.context, quant_cache_dir())
                                if report is not None and made is not None else None)
        checkpoint_formats.report_conversions(stored, report.formats() if report else {})
        log.info("Overdrive %s", install_attention(patched, attention_config))
        return io.NodeOutput(patched)

"""Quantize Model: measured int8/fp8 (or int4) layers in the diffusion model (comfy_host/quantized_model.py)."""
from comfy_api.latest import io

from ..attention.choice import MODES as ATTENTION_MODES
from ..attention.choice import AttentionConfig
from ..comfy_host.quantize_calibration import DEFAULT_STEPS, MAX_STEPS, CalibrationRun
from ..comfy_host.quantized_model import quantize_model
from ..quantization import QuantConfig, format_names
from ..quantization.formats import bit_widths
from .schema import node_schema, patched_copy_input

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
        return io.NodeOutput(quantize_model(model, config, run, attention_config))

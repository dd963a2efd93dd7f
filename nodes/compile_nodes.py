"""Compile Model and Compile VAE (comfy_host/compiled_model.py)."""
from comfy_api.latest import io

from ..comfy_host.compiled_model import compile_options, compiled_model, compiled_vae
from ..compiler import CompileOptions
from ..compiler.options import DYNAMIC, MODES
from ..families import family_titles
from .schema import node_schema, patched_copy_input

DEFAULTS = CompileOptions()  # the nodes' defaults are the core's
FAST_ATTENTION = True  # Compile Model installs the 16-bit attention chooser (attention_override.EXACT) unless off
COMPILE_ENCODER = False  # img2img only: most workflows never encode

MODE_TOOLTIP = (
    "default: quickest to compile. max-autotune: benchmarks matrix and convolution kernels on your GPU during the "
    "first run (a much slower first image; sometimes faster after)."
)
CUDA_GRAPHS_TOOLTIP = (
    "Replay each sampling step as one CUDA graph instead of launching thousands of small kernels from Python: "
    "the largest gain on fast GPUs (bench/README.md has the figures). Each new resolution records its "
    "own graph once and keeps its working memory reserved. DiT models replay each block as its own graph (one "
    "block's working memory reserved). Ignored on the CPU."
)
DYNAMIC_TOOLTIP = (
    "How new resolutions and batch sizes are handled. auto: the first shape gets a specialised graph, a second shape "
    "compiles one shape-generic graph that serves all later ones (batch 1 gets one of its own: at most 3 graphs). static: one specialised graph per shape "
    "(fastest, but each new shape compiles again). dynamic: one shape-generic graph from the start. DiT models "
    f"({family_titles()}) follow the same rule per block."
)

REGIONAL_TOOLTIP = (
    "UNets (SD1.5, SDXL): compile each distinct transformer block once and reuse it for every block of that shape, "
    "inside one graph: SDXL's 70 blocks become 2, so the first run compiles several times faster. Turn off only to "
    "compare (Overdrive falls back to whole-graph compiling by itself when regions fail). DiT models always compile "
    "per block (Flux.1-dev: 57 blocks, 2 graphs); this switch does not apply to them."
)

FAST_ATTENTION_TOOLTIP = (
    "Run attention on the fastest 16-bit kernel this GPU has, chosen per shape at its first call by timing it on "
    "that call's inputs: torch's SDPA as ComfyUI calls it, SDPA's cuDNN kernel, or FlashAttention-3 on Hopper (H100, "
    "H200) where fa3-fwd is installed. The result equals SDPA's to 16-bit rounding; the log shows the figures. "
    "Quantize Model's attention setting, where set, takes precedence. Off: ComfyUI's own attention."
)

COMPILE_MODEL_DESCRIPTION = (
    "Compiles the diffusion model with torch.compile (Inductor/Triton) at the first sampling step: a UNet as one graph, "
    f"a DiT ({family_titles()}) block by block, each distinct block once. Graphs are shared by "
    "every checkpoint of the same architecture. Before or after DeepCache, its full and shallow steps are compiled. If "
    "compiling fails, sampling continues on the normal (eager) path with a warning in the log."
)
COMPILE_VAE_DESCRIPTION = (
    "Compiles the VAE's decoder (and optionally encoder) with torch.compile. Falls back to the normal path with a "
    "warning if compiling fails. Wan's video VAE (also Qwen-Image's) is not compiled (it decoded slower compiled): "
    "its 3-D convolutions switch to the channels-last layout instead."
)

PRECOMPILE_TOOLTIP = (
    "Save each compiled call whole (a UNet's first resolution, each distinct DiT block), so that after a restart it "
    "loads in seconds instead of being traced again. The saved code skips PyTorch's own checks; Overdrive makes the "
    "same ones itself: shapes, settings, where the weights are, and every function, module-level flag, model "
    "attribute and hook the traced code read. A call that differs runs through the normal compile. Turn off only "
    "to compare."
)


def compile_settings() -> list:
    """The inputs both compile nodes take, declared once."""
    return [io.Combo.Input("mode", options=list(MODES), default=DEFAULTS.mode, tooltip=MODE_TOOLTIP),
            io.Boolean.Input("cuda_graphs", default=DEFAULTS.cuda_graphs, tooltip=CUDA_GRAPHS_TOOLTIP),
            io.Combo.Input("dynamic", options=list(DYNAMIC), default=DEFAULTS.dynamic, tooltip=DYNAMIC_TOOLTIP)]


class OverdriveCompileModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            "OverdriveCompileModel", "Compile Model (Overdrive)", COMPILE_MODEL_DESCRIPTION,
            inputs=[
                patched_copy_input(io.Model, "model", "diffusion model", "compile"),
                *compile_settings(),
                io.Boolean.Input("regional", default=DEFAULTS.regional, tooltip=REGIONAL_TOOLTIP, optional=True),
                io.Boolean.Input("precompile", default=DEFAULTS.precompile, tooltip=PRECOMPILE_TOOLTIP,
                                 optional=True),
                io.Boolean.Input("fast_attention", default=FAST_ATTENTION, tooltip=FAST_ATTENTION_TOOLTIP,
                                 optional=True),
            ],
            outputs=[io.Model.Output(tooltip="The same model, running through compiled code.")],
        )

    @classmethod
    def execute(cls, model, mode=DEFAULTS.mode, cuda_graphs=DEFAULTS.cuda_graphs, dynamic=DEFAULTS.dynamic,
                regional=DEFAULTS.regional, precompile=DEFAULTS.precompile,
                fast_attention=FAST_ATTENTION) -> io.NodeOutput:
        options = compile_options(mode=mode, cuda_graphs=cuda_graphs, dynamic=dynamic, regional=regional,
                                  precompile=precompile)
        return io.NodeOutput(compiled_model(model, options, fast_attention))


class OverdriveCompileVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            "OverdriveCompileVAE", "Compile VAE (Overdrive)", COMPILE_VAE_DESCRIPTION,
            inputs=[
                patched_copy_input(io.Vae, "vae", "VAE", "compile", "Wan's video VAE is returned itself, its "
                                   "convolution weights in the channels-last layout (same values)."),
                *compile_settings(),
                io.Boolean.Input("compile_encoder", default=COMPILE_ENCODER,
                                 tooltip="Also compile encode (img2img, inpainting). Costs one more compile the "
                                         "first time an image is encoded."),
            ],
            outputs=[io.Vae.Output(tooltip="The same VAE, decoding through compiled code.")],
        )

    @classmethod
    def execute(cls, vae, mode=DEFAULTS.mode, cuda_graphs=DEFAULTS.cuda_graphs, dynamic=DEFAULTS.dynamic,
                compile_encoder=COMPILE_ENCODER) -> io.NodeOutput:
        options = compile_options(mode=mode, cuda_graphs=cuda_graphs, dynamic=dynamic)
        return io.NodeOutput(compiled_vae(vae, options, compile_encoder))

"""DeepCache: a thin ComfyUI adapter over overdrive.step_cache (MODEL -> MODEL, through a ModelPatcher object patch)."""
from comfy_api.latest import io

from ..comfy_host.step_cached_model import with_step_cache
from ..families import family_titles
from ..step_cache import DeepCacheConfig
from ..step_cache.config import MODES
from .schema import node_schema, patched_copy_input

DEFAULTS = DeepCacheConfig()  # the node's defaults are the core's

DESCRIPTION = (
    "DeepCache (Ma et al., 2023) and its DiT form: on most sampling steps only the first blocks run and the rest is "
    "reused from the last full step, for a small change in detail. Full steps are exact. UNets (SD1.5, SD2, SDXL) "
    f"reuse their deep features; DiTs ({family_titles()}) reuse the residual of their later blocks, on a fixed"
    " schedule or where the first blocks' output barely changed (measured per step, or once per size and step "
    "schedule and replayed: the DiTs' default). Works with "
    "Compile Model (before or after it), Quantize Model, LoRA and Switch Weights. ControlNet and block patches make "
    "their steps run the whole model. The log shows each run's full / reused steps."
)
INTERVAL_TOOLTIP = (
    "fixed mode (and auto on UNets): run the whole model every this many sampling steps; the steps in between reuse "
    "its deep features (UNets) or the residual of its later blocks (DiTs) and run only the first blocks. 3 is "
    "DeepCache's setting; higher is faster and drifts more. 1 = no caching: the image is the same as without this "
    "node. Not read in adaptive and calibrated modes, nor by auto on DiTs.")
DEPTH_TOOLTIP = (
    "UNets: how many of the outermost skip branches (input/output block pairs) still run on cached steps; 1, the "
    f"paper's choice, runs about a tenth of a full step (SD1.5 at most 12, SDXL 9). DiTs ({family_titles()}): "
    "how many of the first transformer blocks run on every step (1 = only the first). Larger is "
    "closer to the uncached image and less fast.")
MODE_TOOLTIP = (
    "auto: fixed on UNets; calibrated on DiTs at their family's threshold, chosen from the fidelity table of the "
    "reference models with learned weights (the threshold input is then not read). "
    "fixed: a full step every cache_interval steps (no extra work per step). adaptive (DiT families only): each step "
    "runs the first blocks, measures how much their output changed since the last full step, and reuses the cache "
    "only while that change is below threshold: few reuses early, many late. Costs one GPU->CPU sync per step. "
    "calibrated (DiT families only): decides as adaptive at the first run of each latent size and step schedule, then "
    "replays those decisions on later prompts with no sync (a new size or step count is measured again).")
THRESHOLD_TOOLTIP = (
    "adaptive and calibrated modes: the largest relative change of the first blocks' output on the image tokens "
    "(mean absolute change / mean magnitude, since the last full step) at which a step still reuses the cache. "
    "Higher is faster and drifts more; 0 never reuses. Ignored in fixed and auto modes.")
START_TOOLTIP = ("Where in the sampling process caching may begin (0 = first step, 1 = last). Steps before it run "
                 "the whole UNet: raise it to keep the early steps, which set the composition, exact.")
END_TOOLTIP = ("Where in the sampling process caching stops (0 = first step, 1 = last). Steps after it run the "
               "whole UNet: lower it to keep the final steps, which refine fine detail, exact.")


class OverdriveDeepCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            "OverdriveDeepCache", "DeepCache (Overdrive)", DESCRIPTION,
            inputs=[
                patched_copy_input(io.Model, "model", "diffusion model", "accelerate"),
                io.Int.Input("cache_interval", default=DEFAULTS.cache_interval, min=1, max=10,
                             tooltip=INTERVAL_TOOLTIP),
                io.Int.Input("cache_depth", default=DEFAULTS.cache_depth, min=1, max=12, tooltip=DEPTH_TOOLTIP),
                io.Float.Input("start_percent", default=DEFAULTS.start_percent, min=0.0, max=1.0, step=0.01,
                               tooltip=START_TOOLTIP),
                io.Float.Input("end_percent", default=DEFAULTS.end_percent, min=0.0, max=1.0, step=0.01,
                               tooltip=END_TOOLTIP),
                io.Combo.Input("mode", options=list(MODES), default=DEFAULTS.mode, tooltip=MODE_TOOLTIP,
                               optional=True),
                io.Float.Input("threshold", default=DEFAULTS.threshold, min=0.0, max=2.0, step=0.005,
                               tooltip=THRESHOLD_TOOLTIP, optional=True),
            ],
            outputs=[io.Model.Output(tooltip="The same model, sampling with DeepCache.")],
        )

    @classmethod
    def execute(cls, model, cache_interval=DEFAULTS.cache_interval, cache_depth=DEFAULTS.cache_depth,
                start_percent=DEFAULTS.start_percent, end_percent=DEFAULTS.end_percent, mode=DEFAULTS.mode,
                threshold=DEFAULTS.threshold) -> io.NodeOutput:
        config = DeepCacheConfig(cache_interval, cache_depth, float(start_percent), float(end_percent), mode=mode,
                                 threshold=float(threshold))
        return io.NodeOutput(with_step_cache(model, config))

"""DeepCache: a thin ComfyUI adapter over overdrive.deepcache (MODEL -> MODEL, through a ModelPatcher object patch)."""
import logging

from ..compiler import CompiledMethod
from ..deepcache import DeepCacheConfig, DeepCacheRunner, UnsupportedUNetError
from .forward_patch import FORWARD, compile_options, deepcache_runner

log = logging.getLogger("overdrive")

INTERVAL_TOOLTIP = (
    "Run the whole UNet every this many sampling steps; the steps in between reuse its deep features and run only "
    "the outer blocks. 3 is the paper's setting (about 2x faster sampling, small changes in detail); higher is "
    "faster and drifts more. 1 = no caching: every step runs the whole UNet, and the image is the same as without "
    "this node.")
DEPTH_TOOLTIP = (
    "How many of the UNet's outermost skip branches (input/output block pairs) still run on cached steps. 1, the "
    "paper's choice for Stable Diffusion: only the first input block, the last output block and the output layer "
    "run, about a tenth of a full step's time: the fastest. Larger values run more of the UNet on cached steps: "
    "closer to the uncached image, less speed-up. At most the UNet's number of input blocks (SD1.5: 12, SDXL: 9).")
START_TOOLTIP = ("Where in the sampling process caching may begin (0 = first step, 1 = last). Steps before it run "
                 "the whole UNet: raise it to keep the early steps, which set the composition, exact.")
END_TOOLTIP = ("Where in the sampling process caching stops (0 = first step, 1 = last). Steps after it run the "
               "whole UNet: lower it to keep the final steps, which refine fine detail, exact.")


def installable(previous, unet) -> bool:
    """True for the forward patches DeepCache knows how to wrap: none, this UNet compiled, or a DeepCache."""
    if isinstance(previous, DeepCacheRunner):
        previous = previous.native
    return previous is None or (isinstance(previous, CompiledMethod) and previous.module is unet)


class OverdriveDeepCache:
    DESCRIPTION = ("DeepCache (Ma et al., 2023): on most sampling steps only the outer blocks of the UNet run and the "
                   "deep part is reused from the last full step: about 2x faster sampling at interval 3 (SD1.5 on an "
                   "H100), for a small change in detail. Full steps are exact. Works with Compile Model (before or "
                   "after it), LoRA and Switch Weights. Only UNet models (SD1.5, SD2, SDXL and their fine-tunes); "
                   "other models pass through unchanged, with a note in the log. ControlNet and unknown patches make "
                   "their steps run the whole UNet. The log shows each run's schedule (full / shallow steps).")
    CATEGORY = "overdrive"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The same model, sampling with DeepCache.",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model to accelerate. It is not modified; a patched copy is "
                                           "returned."}),
            "cache_interval": ("INT", {"default": 3, "min": 1, "max": 10, "tooltip": INTERVAL_TOOLTIP}),
            "cache_depth": ("INT", {"default": 1, "min": 1, "max": 12, "tooltip": DEPTH_TOOLTIP}),
            "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                        "tooltip": START_TOOLTIP}),
            "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip": END_TOOLTIP}),
        }}

    def patch(self, model, cache_interval=3, cache_depth=1, start_percent=0.0, end_percent=1.0):
        config = DeepCacheConfig(cache_interval, cache_depth, float(start_percent), float(end_percent))
        patched = model.clone()
        unet = patched.model.diffusion_model
        previous = patched.object_patches.get(FORWARD)
        if not installable(previous, unet):
            log.warning("Overdrive DeepCache: this model's diffusion_model.forward is already replaced by %s, which "
                        "DeepCache cannot wrap without bypassing it; the model is returned unchanged.",
                        type(previous).__name__)
            return (patched,)
        native = previous.native if isinstance(previous, DeepCacheRunner) else previous
        options = compile_options(native)
        try:
            runner = deepcache_runner(patched, config, native, options)
        except UnsupportedUNetError as error:
            log.warning("Overdrive DeepCache: %s; DeepCache supports openaimodel UNets (SD1.5, SD2, SDXL). The model "
                        "is returned unchanged.", error)
            return (patched,)
        patched.add_object_patch(FORWARD, runner)
        # ComfyUI (before sample_sigmas reached the model) never tells a model that sampling ended: the runner logs a
        # run's schedule when the next run on this model starts.
        log.info("Overdrive DeepCache on %s: %s, %d of %d skip branches run on shallow steps%s%s; a run's schedule "
                 "(full / shallow steps) is logged when the next one starts", type(unet).__name__, config.describe(),
                 cache_depth, runner.paths.skip_branches, ", paths compiled" if options is not None else "",
                 ", replacing the DeepCache already on this model" if isinstance(previous, DeepCacheRunner) else "")
        return (patched,)

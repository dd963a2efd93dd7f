"""DeepCache on ComfyUI's side: the step cache on a clone of the model (the DiT step cache for a family's model,
DeepCache's paths for a UNet), kept with Compile Model's forward where one is installed."""
import logging

from ..core.stack import Stack
from ..families import family_of, family_titles
from ..step_cache import DeepCacheConfig, DeepCacheConfigError, UnsupportedUNetError
from .forward_patch import foreign_forward, install, installed_stack

log = logging.getLogger("overdrive")


def with_step_cache(model, config: DeepCacheConfig):
    """A clone of `model` sampling with `config`'s step cache; where it cannot wrap the model's forward, the clone
    unchanged with a warning."""
    cache_depth = config.cache_depth
    patched = model.clone()
    unet = patched.model.diffusion_model
    family = family_of(unet)
    if family is None and config.measured:
        raise DeepCacheConfigError(f"mode={config.mode!r} applies to DiT models ({family_titles()}); "
                                   f"this {type(unet).__name__} takes mode='fixed' (cache_interval sets its "
                                   "schedule).")
    foreign = foreign_forward(patched)
    if foreign is not None:
        log.warning("Overdrive DeepCache: this model's diffusion_model.forward is already replaced by %s, which "
                    "DeepCache cannot wrap without bypassing it; the model is returned unchanged.",
                    type(foreign).__name__)
        return patched
    previous = installed_stack(patched) or Stack()
    try:
        forward = install(patched, previous.with_cache_config(config))
    except UnsupportedUNetError as error:
        log.warning("Overdrive DeepCache: %s; DeepCache supports openaimodel UNets (SD1.5, SD2, SDXL) and the DiT "
                    "families. The model is returned unchanged.", error)
        return patched
    # ComfyUI (before sample_sigmas reached the model) never tells a model that sampling ended: a run's schedule
    # is logged when the next run on this model starts.
    if family is not None:
        log.info("Overdrive DeepCache on %s (%s): %s; a run's full / reused steps are logged when the next run "
                 "starts", type(unet).__name__, family.name, forward.describe())
    else:
        log.info("Overdrive DeepCache on %s: %s, %d of %d skip branches run on shallow steps%s%s; a run's schedule "
                 "(full / shallow steps) is logged when the next one starts", type(unet).__name__,
                 config.describe(), cache_depth, forward.paths.skip_branches,
                 ", paths compiled" if previous.compile is not None else "",
                 ", replacing the DeepCache already on this model" if previous.cache_config is not None else "")
    return patched

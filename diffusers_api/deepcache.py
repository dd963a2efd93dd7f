"""deepcache_: DeepCache on a diffusers UNet2DConditionModel, or the DiT step cache on a family transformer (Flux,
Wan, Qwen-Image, SD3, Z-Image; a pipeline's, or a bare one)."""
from ..attention.routing import unwrapped
from ..step_cache import DeepCacheConfig, DeepCacheConfigError, DeepCacheRunner
from ..families import family_of
from ..core.stack import Stack
from .installed import DiffusersHost, install, install_each, installed_stack
from .targets import SUPPORTED, is_diffusers_unet, is_pipeline, target_modules


def deepcache_(target, config: DeepCacheConfig | None = None):
    """Install the step cache on the UNet's or transformer's forward; returns what counts its steps (`.stats` /
    `.last_stats`: full and shallow steps of the current / last run; `.reset()` ends a run). A Wan 2.2 A14B pipeline's
    two experts each get their own cache over the steps they run: {"transformer": ..., "transformer_2": ...}.

    Steps are keyed on the timestep the pipeline passes, so the schedule follows the scheduler's steps however
    classifier-free guidance batches its calls; a run starts when the timestep goes up (a new pipeline call).
    `start_percent`/`end_percent` are fractions of the timestep range (0 = the noisiest): the scheduler's training
    timesteps for a UNet, the range the transformer takes for a DiT.
    - UNet: DeepCache (a DeepCacheRunner). Full steps are exactly the model's own forward (verified on the first full
      call); shallow steps reuse the deep feature of the last full step.
    - DiT transformer: on reused steps only the first `cache_depth` blocks run and the rest add the residual of the
      last full step (a BlockStepCache; `mode="adaptive"` decides per step from the first blocks' change, with
      `threshold`; `mode="calibrated"` so at the first run of a latent size and noise level, replayed after; the
      default `auto` is calibrated at the family's threshold). A true-CFG pipeline's cond and uncond calls each keep
      their own residuals.
    If the forward was compiled (compile_), both paths run the compiled code. Calling deepcache_ again replaces the
    configuration.
    """
    denoisers = target_modules(target, "deepcache_")
    config = DeepCacheConfig() if config is None else config
    if not isinstance(config, DeepCacheConfig):
        raise TypeError(f"deepcache_: config must be a DeepCacheConfig, not {type(config).__name__}; e.g. "
                        "DeepCacheConfig(mode=\"fixed\", cache_interval=3). Nothing was changed.")
    stacks = [(module, (installed_stack(module) or Stack()).with_cache_config(config)) for _, module in denoisers]
    module = denoisers[0][1]
    if not is_diffusers_unet(module) and family_of(module) is not None:  # a pipeline's DiTs are all of a family
        forwards = install_each(stacks, host_for=DiffusersHost, keep_runner=False)
        caches = {name: unwrapped(forward).step_cache for (name, _), forward in zip(denoisers, forwards)}
        return caches if len(caches) > 1 else caches[denoisers[0][0]]
    if not is_diffusers_unet(module):
        raise TypeError(f"deepcache_ needs a diffusers UNet2DConditionModel or a DiT transformer of a known family "
                        f"(or a pipeline with one), not {type(module).__name__}. Supported pipelines: {SUPPORTED}. "
                        "Nothing was changed.")
    if config.measured:  # a UNet's paths have no first blocks to measure
        raise DeepCacheConfigError(f"mode={config.mode!r} applies to DiT transformers; a UNet takes mode='fixed' "
                                   "(cache_interval sets its schedule). Nothing was changed.")
    scheduler_config = getattr(getattr(target, "scheduler", None), "config", None) if is_pipeline(target) else None
    timesteps = int((scheduler_config or {}).get("num_train_timesteps", 1000))
    runner: DeepCacheRunner = unwrapped(install(module, stacks[0][1], DiffusersHost(module, timesteps),
                                                keep_runner=False))
    return runner  # a new run, new statistics

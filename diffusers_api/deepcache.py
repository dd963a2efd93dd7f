"""deepcache_: DeepCache on a diffusers UNet2DConditionModel (a pipeline's, or a bare one)."""
from ..deepcache import DeepCacheConfig, DeepCacheRunner
from ..stack import Stack
from .installed import DiffusersHost, install, installed_stack
from .targets import is_pipeline, target_unet


def deepcache_(target, config: DeepCacheConfig | None = None) -> DeepCacheRunner:
    """Install DeepCache on the UNet's forward; returns the runner (`.stats`/`.last_stats`: full and shallow steps
    and calls of the current/last run; `.reset()` ends a run).

    Steps are keyed on the timestep the pipeline passes, so the schedule follows the scheduler's steps however
    classifier-free guidance batches its calls; a run starts when the timestep goes up (a new pipeline call).
    `start_percent`/`end_percent` are fractions of the scheduler's training timesteps (0 = the noisiest).
    If the UNet's forward was compiled (compile_), DeepCache's full and shallow paths are compiled with the same
    options. Calling deepcache_ again replaces the configuration. Full steps are exactly the model's own forward
    (verified on the first full call); shallow steps reuse the deep feature of the last full step.
    """
    unet = target_unet(target, "deepcache_")
    config = DeepCacheConfig() if config is None else config
    if not isinstance(config, DeepCacheConfig):
        raise TypeError(f"deepcache_: config must be a DeepCacheConfig, not {type(config).__name__}; e.g. "
                        "DeepCacheConfig(cache_interval=3). Nothing was changed.")
    scheduler_config = getattr(getattr(target, "scheduler", None), "config", None) if is_pipeline(target) else None
    timesteps = int((scheduler_config or {}).get("num_train_timesteps", 1000))
    stack = (installed_stack(unet) or Stack()).with_cache(config)
    return install(unet, stack, DiffusersHost(unet, timesteps), keep_runner=False)  # a new run, new statistics

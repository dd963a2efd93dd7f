"""deepcache_: DeepCache on a diffusers UNet2DConditionModel (a pipeline's, or a bare one)."""
from ..compiler import CompiledMethod
from ..deepcache import DeepCacheConfig, DeepCacheRunner
from .installed import compiled_runner_parts, install_runner_parts, installed, runner_of
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
    native = installed(unet)
    previous = runner_of(unet)
    if previous is not None:
        native = None if previous.native == previous.paths.native_forward else previous.native
    scheduler_config = getattr(getattr(target, "scheduler", None), "config", None) if is_pipeline(target) else None
    timesteps = int((scheduler_config or {}).get("num_train_timesteps", 1000))
    runner = DeepCacheRunner.for_diffusers_unet(unet, config, num_train_timesteps=timesteps, native_forward=native)
    if isinstance(native, CompiledMethod):
        install_runner_parts(runner, compiled_runner_parts(runner, unet, native.options))
    unet.forward = runner
    return runner

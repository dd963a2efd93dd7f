"""A StepClock (step_cache/clock.py) in each sampling run of a model that carries an Overdrive forward: DeepCache then
knows each call's step from the sampler's own callback, without reading the call's sigma from the GPU."""
from comfy.patcher_extension import WrappersMP

from ..step_cache.clock import STEP_CLOCK, StepClock

KEY = STEP_CLOCK  # the wrapper's key among ComfyUI's, named as the option it sets
# ComfyUI's k-diffusion samplers that evaluate the model once per step, at sigmas[i]. Others (heun, dpmpp_2s_ancestral,
# dpmpp_sde, ...) evaluate more sigmas per step than the schedule has: their calls keep being read from the GPU.
ONE_CALL_PER_STEP = frozenset({"euler", "euler_ancestral", "lms", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu",
                               "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm", "ipndm", "ipndm_v", "deis"})


def add(model) -> None:
    """Install the wrapper on ModelPatcher `model` (once, whatever the number of Overdrive nodes on it)."""
    remove(model)
    model.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, KEY, sample_with_step_clock)


def remove(model) -> None:
    model.remove_wrappers_with_key(WrappersMP.SAMPLER_SAMPLE, KEY)


def sample_with_step_clock(executor, guider, sigmas, extra_args, callback, *args, **kwargs):
    """A SAMPLER_SAMPLE wrapper: this run's model options (ComfyUI's copy for the run) get a StepClock over `sigmas`,
    moved on by the sampler's callback, which still reaches the caller's callback (the progress bar, previews)."""
    function = getattr(getattr(executor.class_obj, "sampler_function", None), "__name__", "")
    if function.removeprefix("sample_") not in ONE_CALL_PER_STEP:
        return executor(guider, sigmas, extra_args, callback, *args, **kwargs)
    clock = StepClock(sigmas)
    extra_args["model_options"].setdefault("transformer_options", {})[STEP_CLOCK] = clock

    def reporting(step, *rest):
        clock.finished(step)
        return callback(step, *rest) if callback is not None else None
    return executor(guider, sigmas, extra_args, reporting, *args, **kwargs)

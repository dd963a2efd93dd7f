"""Sparse Video Attention on a ComfyUI model (attention/video_sparsity.py): the mask rides on Overdrive's attention
override, which reads the video grid ComfyUI's model code puts in transformer_options, and a DIFFUSION_MODEL wrapper
sets the phase (dense for the first sampling steps) before each model call."""
import functools
import logging

from comfy.patcher_extension import WrappersMP

from ..attention.video_sparsity import VideoSparsity, set_dense
from ..families import family_of, family_titles
from ..step_cache.schedule import host_floats
from .attention_override import install_video_sparsity
from .comfy_steps import RunSchedule

log = logging.getLogger("overdrive")
WRAPPER_KEY = "overdrive_sparse_video"


def video_family_names() -> str:
    return family_titles(lambda family: family.video_grid)


def with_sparse_video(model, sparsity: VideoSparsity):
    """A clone of `model` whose video self-attention runs masked by `sparsity`; the clone unchanged, with a warning,
    where the model is not one of the video families or another node overrides attention."""
    clone = model.clone()
    if sparsity.dense_steps >= 1.0:
        log.info("Overdrive Sparse Video Attention: every step dense (dense_steps 1): nothing changed.")
        return clone
    family = family_of(clone.get_model_object("diffusion_model"))
    if family is None or not family.video_grid:
        log.warning("Overdrive Sparse Video Attention: %s is not a video model it masks (%s); its attention stays "
                    "dense.", type(clone.model.diffusion_model).__name__, video_family_names())
        return clone
    if not install_video_sparsity(clone, sparsity):
        log.warning("Overdrive Sparse Video Attention: another node already overrides attention; this model's "
                    "attention stays as that node sets it.")
        return clone
    clone.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY,
                               functools.partial(_set_phase, sparsity, RunSchedule()))
    log.info("Overdrive Sparse Video Attention on %s: each frame attends to %d frame(s) on each side and the first %d; "
             "the first %.0f%% of the sampling steps dense.", family.title, sparsity.window, sparsity.sink,
             100 * sparsity.dense_steps)
    return clone


def _set_phase(sparsity: VideoSparsity, schedule: RunSchedule, executor, *args, **kwargs):
    options = kwargs.get("transformer_options")
    if options is None:  # ComfyUI's model forwards pass it positionally, the one dict among their arguments
        options = next((arg for arg in args if isinstance(arg, dict)), {})
    set_dense(sparsity, in_dense_steps(options, schedule(options), sparsity.dense_steps))
    return executor(*args, **kwargs)


def in_dense_steps(options: dict, schedule: tuple, share: float) -> bool:
    """Whether this model call's step is among the first `share` of its run's steps (`schedule`: the run's sigmas).
    It reads the call's sigma on the host, a wait for the GPU per call: a video model's step runs for seconds. Dense
    where the call carries no schedule (the faithful side)."""
    if share <= 0.0 or share >= 1.0:
        return share >= 1.0
    sigmas = options.get("sigmas")
    if not schedule or sigmas is None:
        return True
    current = max(host_floats([sigmas])[0])
    step = sum(1 for value in schedule if value > current * (1 + 1e-6))
    return step < round(share * (len(schedule) - 1))

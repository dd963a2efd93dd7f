"""Which sampling step a ComfyUI model call belongs to, read from its transformer_options: the step reader ComfyUI's
nodes give the DiT step cache (blockwise.BlockwiseForward's `read_step`; the diffusers API has its own)."""
import torch

from ..step_cache.schedule import DeferredFloats, host_floats

# transformer_options["patches"] entries of Overdrive's own (QuantizeModel's device follower): they never touch what
# a block computes; and block replacements marked `overdrive_own` (sequence parallelism's, which run each block on its
# share of the tokens). Any other patch may read or change block outputs, so its calls run every block.
OWN_PATCHES = "overdrive_"


class RunSchedule:
    """The sampler's sigma list of the run a call belongs to (transformer_options["sample_sigmas"]), as host floats:
    read once per run, () where the call carries none."""

    def __init__(self):
        self._schedule = (None, ())  # (the run's sample_sigmas tensor, its values)

    def __call__(self, options: dict) -> tuple:
        sample_sigmas = options.get("sample_sigmas")
        if not isinstance(sample_sigmas, torch.Tensor):
            self._schedule = (None, ())
        elif sample_sigmas is not self._schedule[0]:
            self._schedule = (sample_sigmas, tuple(host_floats([sample_sigmas])[0]))
        return self._schedule[1]


class ComfySteps:
    """A call returns a function giving (sigma, run key, branch, why the call cannot be cached or None): the call's
    sigma is copied to the host without waiting (DeferredFloats), so the host queues the model's first blocks before
    it waits for the previous step to end; the sampler's sigma list is read once per run."""

    def __init__(self):
        self._schedule = RunSchedule()

    def __call__(self, args, kwargs):
        options = kwargs.get("transformer_options") or {}
        x = args[0] if args else kwargs.get("x")
        sigmas = options.get("sigmas")
        schedule = self._schedule(options)
        pending = DeferredFloats([sigmas]) if isinstance(sigmas, torch.Tensor) else None
        first = x[0] if isinstance(x, (list, tuple)) and x else x  # LTX-2 gets [video, audio]
        run_key = (latent_shapes(x), str(getattr(first, "dtype", "")), str(getattr(first, "device", "")), schedule)
        branch = (tuple(options.get("cond_or_uncond") or ()), latent_shapes(x))
        structural = None
        if kwargs.get("control") is not None:
            structural = "ControlNet residuals are added between blocks"
        elif not all(getattr(block, "overdrive_own", False) for block in (
                (options.get("patches_replace") or {}).get("dit") or {}).values()) or any(
                value for name, value in (options.get("patches") or {}).items() if not name.startswith(OWN_PATCHES)):
            structural = "a node patches this model's blocks"

        def read():
            step_sigmas = pending.values()[0] if pending is not None else []
            unsupported = structural
            if not step_sigmas:
                unsupported = "the call carries no sigma (transformer_options['sigmas'])"
            elif len(set(step_sigmas)) > 1:
                unsupported = "per-sample sigmas differ within the batch"
            return (max(step_sigmas) if step_sigmas else 0.0), run_key, branch, unsupported
        return read


def latent_shapes(x) -> tuple:
    """The shape of a model call's latent, or of each of its parts (LTX-2's video and audio): a run and a branch of the
    step cache hold one size."""
    if isinstance(x, (list, tuple)):
        return tuple(tuple(getattr(part, "shape", ())) for part in x)
    return tuple(getattr(x, "shape", ()))

"""Which sampling step a diffusers transformer call belongs to, for the DiT step cache. diffusers passes no sigmas,
only the timestep its scheduler gives the model, each family in its own range (Flux and Qwen-Image t / 1000, Wan and
SD3 t, Z-Image (1000 - t) / 1000: `families.Family.noise_timestep` / `clean_timestep`). A step is one timestep value,
read as a noise level from 1 (pure noise) to 0; the calls of one step (true CFG's cond and uncond, made one after the
other) are told apart by their order within it, so each keeps its own residuals."""
import inspect

import torch

from ..step_cache.schedule import DeferredFloats

# Inputs that add ControlNet residuals between blocks (Flux, Qwen-Image, Z-Image; SD3): skipped blocks would drop them.
CONTROLNET_INPUTS = ("controlnet_block_samples", "controlnet_single_block_samples", "block_controlnet_hidden_states")
TIMESTEP_NAMES = ("timestep", "t")


class DiffusersSteps:
    """The reader a BlockwiseForward calls at each transformer call (stack.Host.read_step): it returns a function that
    gives the call's step when the step cache decides (the timestep's copy to the host is queued, not waited for)."""

    def __init__(self, module, family):
        self.signature = inspect.signature(type(module).forward)
        self.module, self.noise, self.clean = module, family.noise_timestep, family.clean_timestep
        self._level = None
        self._index = 0  # this call's place among the calls at the current noise level

    def __call__(self, args, kwargs):
        given = self.signature.bind_partial(self.module, *args, **kwargs).arguments
        latents = list(given.values())[1] if len(given) > 1 else None  # the first argument after self
        shape = tuple(tuple(t.shape) for t in latents) if isinstance(latents, (list, tuple)) \
            else tuple(getattr(latents, "shape", ()))
        first = latents[0] if isinstance(latents, (list, tuple)) and latents else latents
        run_key = (shape, str(getattr(first, "dtype", "")), str(getattr(first, "device", "")))
        timestep = next((given[name] for name in TIMESTEP_NAMES if name in given), None)
        if not isinstance(timestep, (torch.Tensor, int, float)):
            return lambda: (0.0, run_key, (0, shape), "the call carries no timestep")
        timestep = torch.as_tensor(timestep).float()
        rows = timestep.reshape(timestep.shape[0] if timestep.ndim else 1, -1)
        levels = (rows - self.clean) / (self.noise - self.clean)
        # Wan 2.2 TI2V gives one timestep per token: a sample's step is its noisiest token's.
        pending = DeferredFloats([levels.amax(1)])
        controlnet = any(given.get(name) is not None for name in CONTROLNET_INPUTS)

        def read():  # called once per call, in call order, when the step cache decides
            per_sample = pending.values()[0]
            level = max(per_sample)
            self._index = self._index + 1 if level == self._level else 0
            self._level = level
            unsupported = None
            if len(set(per_sample)) > 1:
                unsupported = "per-sample timesteps differ within the batch"
            elif controlnet:
                unsupported = "ControlNet residuals are added between blocks"
            return level, run_key, (self._index, shape), unsupported
        return read

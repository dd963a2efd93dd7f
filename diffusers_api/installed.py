"""What Overdrive installed on a diffusers UNet's forward (core/stack.py), and how each API function extends it: compile_
then deepcache_ (or the other way round) compiles DeepCache's two paths; quantize_ calibrates on the eager forward and
rebuilds the same Stack over the new layers, so compiled graphs are keyed by them."""
import contextlib

from ..step_cache import DeepCacheRunner
from ..core.stack import Host, Stack, build, stack_of
from .steps import DiffusersSteps


class DiffusersHost(Host):
    """A diffusers UNet2DConditionModel (steps keyed on the timestep: diffusers passes no sigmas), or a DiT transformer
    of a family with a diffusers plug-in (families/: Flux, Wan, Qwen-Image, SD3, Z-Image), compiled block by block,
    with the step cache reading its steps from the timestep too (steps.py)."""

    def __init__(self, module, num_train_timesteps: int = 1000):
        super().__init__(module)
        self.num_train_timesteps = num_train_timesteps
        current = installed(module)
        self.foreign = current if current is not None and stack_of(current) is None else None
        family = self.family()
        self.read_step = DiffusersSteps(module, family) if family is not None else None

    def percent_to_sigma(self, percent: float) -> float:
        """A DiT's window: a fraction of the timestep range its forward takes (0 = pure noise), as for the UNet; the
        reader hands the cache noise levels from 1 to 0."""
        return 1.0 - percent

    def unet_runner(self, config, native):
        return DeepCacheRunner.for_diffusers_unet(self.module, config, num_train_timesteps=self.num_train_timesteps,
                                                  native_forward=native)

    def eager_forward(self):
        return self.foreign

    def split(self, inner, config):
        from .sequence_split import SplitForward
        return SplitForward(self.module, inner if inner is not None else self.foreign, config, self.family())  # someone else's forward (e.g. their own torch.compile) keeps running on full steps


def installed(module, method: str = "forward"):
    """The instance-level replacement of `module.<method>` (ours or anyone's), or None."""
    return module.__dict__.get(method)


def installed_stack(module) -> Stack | None:
    return stack_of(installed(module))


def install(module, stack: Stack, host: Host | None = None, keep_runner: bool = True):
    """`stack` built over `module` and set as its forward; returns it. `keep_runner`: a step-cache runner already
    there with the same settings is updated in place (callers hold it for its statistics)."""
    return install_each([(module, stack)], host_for=lambda _: host, keep_runner=keep_runner)[0]


def install_each(stacks, host_for=None, keep_runner: bool = True) -> list:
    """Each (module, stack)'s forward built first, then all set: a failure changes none of the modules (a pipeline's
    two transformers are accelerated together or not at all). Returns the forwards."""
    forwards = [build(stack, (host_for(module) if host_for else None) or DiffusersHost(module),
                      keep=installed(module) if keep_runner else None) for module, stack in stacks]
    for (module, _), forward in zip(stacks, forwards):
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward
    return forwards


def rebuild(module) -> None:
    """After `module`'s layers changed (quantize_): a compiled Stack built again over them, so its graphs are keyed by
    the new layers; a step-cache runner stays the same object. An eager Stack depends on no layer and is left as it
    is (its runner may call someone else's forward on full steps)."""
    stack = installed_stack(module)
    if stack is not None and stack.compile is not None:
        install(module, stack)


@contextlib.contextmanager
def eager_forward(module):
    """Run `module`'s own class forward inside the block (calibration must see every layer, uncompiled)."""
    current = module.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if current is not None:
            module.forward = current

"""Which weights a module runs with, as a cheap token (DeepCache never reuses features across weight changes; a
precompiled frame re-checks where the weights live only when the module tree changed).

ComfyUI applies LoRA and other weight patches by installing new Parameters, QuantizeModel and SwitchWeights swap
modules; all of these go through `nn.Module.__setattr__`, which calls torch's global parameter/module registration
hooks. A process-wide generation counter bumped by those hooks tells `WeightsWatch` when anything, anywhere, may have
changed; only then does it walk the module tree again. Sampling steps therefore cost one integer comparison instead
of a walk over every module (in Python, a large share of a cached UNet step's time).
"""
import torch
import torch.nn as nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

_generation = 0


def _bump(*_args):
    # No lock: a racing increment may be lost, but the value still moves, which is all a watcher compares.
    global _generation
    _generation += 1


def _on_registration(registry: str):
    def hook(module, name, _value):
        # Under torch.compile this is a registration inside a traced forward: a temporary container such as
        # diffusers' `self.resnets[1:]` (a new ModuleList per call), never a weight swap. Touching the counter there
        # made Dynamo guard on its value and recompile every call (torch 2.11: SDXL ran eager after 8 recompiles).
        if torch.compiler.is_compiling():
            return
        # Only a replacement can change what an existing tree runs; filling a new container (that same slice in
        # eager mode, or building a model) does not, and must not send every watcher on a walk each step.
        if getattr(module, registry).get(name) is not None:
            _bump()
    return hook


_hooks = []


def _watch_registrations() -> None:
    """Install the two process-wide hooks at the first read of the generation, not at import: until something
    reads it, no watcher exists whose token could go stale."""
    if not _hooks:
        _hooks.append(register_module_parameter_registration_hook(_on_registration("_parameters")))
        _hooks.append(register_module_module_registration_hook(_on_registration("_modules")))


def weights_generation() -> int:
    """Changes whenever a Parameter or a submodule of any module in this process is replaced."""
    if not _hooks:
        _watch_registrations()
    return _generation


def weights_token(module: nn.Module) -> int:
    """Changes when a submodule or a Parameter object of `module` is replaced. Walks the `_modules`/`_parameters`
    dicts directly (`module.parameters()`' named traversal is several times slower)."""
    ids = []
    stack = [module]
    while stack:
        current = stack.pop()
        ids.append(id(current))
        ids.extend(id(p) for p in current._parameters.values() if p is not None)
        stack.extend(child for child in current._modules.values() if child is not None)
    return hash(tuple(ids))


class WeightsWatch:
    """`weights_token(module)`, recomputed only when the registration generation moved since the last walk."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._generation = None
        self._token = None

    def token(self) -> int:
        generation = weights_generation()  # read before the walk: a change during it forces another walk next time
        if generation != self._generation:
            self._token = weights_token(self.module)
            self._generation = generation
        return self._token

"""The diffusion model's forward as Overdrive's nodes install it: one ModelPatcher object patch,
"diffusion_model.forward", built from a Stack (core/stack.py) over the patcher's own diffusion model. Each node reads the
Stack installed on its input, extends it and installs the result on its clone; QuantizeModel and SwitchWeights
rebuild the same Stack over their new layers or weights.
"""
import hashlib
import weakref

import torch
from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed
from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

from ..compiler import CompiledMethod
from ..compiler.block_graphs import BlockGraphs
from ..step_cache import DeepCacheRunner
from ..quantization.low_rank import LowRankSidePath
from ..core.stack import Host, Stack, build, stack_of
from . import conds_on_device, step_clock, traceable_ops
from .comfy_call_options import COMFY_CALL_OPTIONS
from .comfy_steps import ComfySteps
from .progress import comfy_progress

FORWARD = "diffusion_model.forward"
# BaseModels whose diffusion model's forward attribute is let go when they go (see let_go_of_forward_with)
_FORWARD_LET_GO = weakref.WeakSet()
# diffusion model -> {the layers swapped in: (its BlockGraphs, weak references to those layers)}; outside the module, so
# that copies of it (Switch Weights) do not copy recordings
GRAPHS_SHELF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# diffusion model -> {resolved DeepCacheConfig: calibrated step decisions}; a switched model is another module (a twin),
# so decisions measured on one file's weights never serve another's
LEARNED_STEPS_SHELF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def swapped_modules(model, prefix: str = "diffusion_model.") -> dict:
    """{key: module or class} of `model`'s object patches under `prefix` that swap layers in at load (QuantizeModel's
    8-bit layers and their LoRA side paths, its fused MLPs' activations)."""
    return {key: value for key, value in model.object_patches.items()
            if key.startswith(prefix) and isinstance(value, (torch.nn.Module, type))}


def swapped_layers(swaps: dict, prefix: str = "diffusion_model.") -> str:
    """A key of the layers `swaps` (swapped_modules) puts under `prefix`: a module with them compiles to another graph
    than the same architecture without."""
    names = sorted(f"{key[len(prefix):]}:{swapped_name(value)}" for key, value in swaps.items()
                   if key.startswith(prefix))
    return hashlib.sha256("|".join(names).encode()).hexdigest()[:16] if names else ""


def swapped_name(value) -> str:
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, LowRankSidePath):
        return f"{type(value).__name__}{value.rank}({type(value.base).__name__})"
    return type(value).__name__


class ComfyHost(Host):
    """A ModelPatcher's diffusion model: compiles show on ComfyUI's progress bar and are keyed by the layers the
    patcher swaps in at load; the step cache's window follows the model's sampling (read at each run start, so a later
    ModelSamplingDiscrete patch is honoured).

    It holds what it reads of the patcher, not the patcher: the forward it builds is one of the patcher's object
    patches, and a patcher reachable from its own patches lives on in a reference cycle, with its model's weights,
    until Python's cycle collector runs (a dropped file's model then stays in host memory beside the next one)."""

    def __init__(self, model):
        super().__init__(model.model.diffusion_model)
        self.swaps = swapped_modules(model)
        self.base_model = weakref.ref(model.model)
        self.read_step = ComfySteps()

    call_options = COMFY_CALL_OPTIONS

    def compiled(self, module, method, options, block_path=""):
        prefix = f"diffusion_model.{block_path}." if block_path else "diffusion_model."
        return CompiledMethod(module, method, self.with_call_options(options), reporter=comfy_progress,
                              announce=not block_path, variant=swapped_layers(self.swaps, prefix))

    def block_graphs(self):
        """One BlockGraphs per set of layers the patcher swaps in, kept on the module tree: a LoRA strength or a
        prompt change runs the node chain again, which rebuilds the forward over the same layers."""
        swapped = sorted(self.swaps.items(), key=lambda item: item[0])
        shelf = GRAPHS_SHELF.setdefault(self.module, {})
        key = tuple((name, id(value)) for name, value in swapped)
        if key not in shelf:
            def forget(_, shelf=shelf, key=key):  # a layer is gone: its recordings (and what they hold) go too
                shelf.pop(key, None)
            shelf[key] = (BlockGraphs(), [weakref.ref(value, forget) for _, value in swapped])
        return shelf[key][0]

    def learned_steps(self, config):
        """The calibrated step cache's decisions for this model and settings, shared by every forward built over them:
        a LoRA, strength or prompt change builds a new one, and replays what the first run measured."""
        return LEARNED_STEPS_SHELF.setdefault(self.module, {}).setdefault(config, {})

    def unet_runner(self, config, native):
        return DeepCacheRunner.for_openai_unet(self.module, config, forward_timestep_embed=forward_timestep_embed,
                                               timestep_embedding=timestep_embedding, native_forward=native,
                                               percent_to_sigma=self.percent_to_sigma, call_options=self.call_options)

    def percent_to_sigma(self, percent):
        base = self.base_model()
        if base is None:  # a copy of this forward (a deep-copied step cache) outlived the model it was built for
            raise RuntimeError("Overdrive's step cache was asked for the sampling schedule of a model that ComfyUI has "
                               "let go of: run the DeepCache node again on the model you sample.")
        return base.model_sampling.percent_to_sigma(percent)


def installed_stack(model) -> Stack | None:
    """The Stack of the forward Overdrive installed on `model` (None: none, or another extension's forward)."""
    return stack_of(model.object_patches.get(FORWARD))


def foreign_forward(model):
    """Another extension's forward patch on `model`, or None."""
    forward = model.object_patches.get(FORWARD)
    return forward if forward is not None and stack_of(forward) is None else None


def install(model, stack: Stack):
    """`stack` built over `model`'s diffusion model and installed as its forward patch, with its sampling's conds on
    the GPU (conds_on_device) and, under DeepCache, a step clock in each sampling run (step_clock); returns the
    forward."""
    if stack.compile is not None:
        traceable_ops.install()
    forward = build(stack, ComfyHost(model))
    if forward is None:
        model.object_patches.pop(FORWARD, None)
        conds_on_device.remove(model)
        step_clock.remove(model)
    else:
        model.add_object_patch(FORWARD, forward)
        let_go_of_forward_with(model.model)
        conds_on_device.add(model)
        if stack.cache_config is not None:  # only DeepCache reads the clock
            step_clock.add(model)
        else:
            step_clock.remove(model)
    return forward


def let_go_of_forward_with(base_model) -> None:
    """When ComfyUI's `base_model` goes, its diffusion model's `forward` attribute goes too: Overdrive's forward, which
    ComfyUI leaves applied after a run (a model dropped while loaded), or the module's own bound method, which an
    unpatch puts back. Either holds the module, a reference cycle that would keep the model's weights (on the GPU, for
    a loaded one) until Python's cycle collector runs, out of ComfyUI's sight."""
    if base_model not in _FORWARD_LET_GO:
        _FORWARD_LET_GO.add(base_model)
        weakref.finalize(base_model, _drop_forward, weakref.ref(base_model.diffusion_model))


def _drop_forward(module_ref) -> None:
    module = module_ref()
    if module is None:  # collected already (at /free): nothing holds it
        return
    forward = module.__dict__.get("forward")
    bound_to_it = getattr(forward, "__self__", None) is module and \
        getattr(forward, "__func__", None) is type(module).forward
    if forward is not None and (bound_to_it or stack_of(forward) is not None):
        del module.__dict__["forward"]


def rebuild(model) -> Stack | None:
    """After `model`'s layers or weights changed (QuantizeModel, SwitchWeights): its Stack built again over them, so
    compiled graphs are keyed by the new layers. Returns that Stack (None: nothing of Overdrive's was installed)."""
    stack = installed_stack(model)
    if stack is not None:
        install(model, stack)
    return stack

"""Model families as plug-ins: what the core needs to know about a diffusion model's repeated blocks.

One small module per family declares its block stacks (the `nn.ModuleList`s of identical blocks, in the order the model
runs them) and, per stack, which block arguments carry the hidden states and in what order a block returns them. Compile
Model compiles each distinct block once from this (regional compilation), and the step cache cuts between blocks with
it. Adding a family is one file here plus its fixture in builtin_models; a diffusers class of the family is one more
Family in that file (`DIFFUSERS` in flux, wan, sd3, zimage, ltxv; Flux.2's and Chroma's in flux), registered below,
unless ComfyUI's class has diffusers' name and layout (Qwen-Image's).
"""
import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("overdrive")


@dataclass(frozen=True)
class BlockStack:
    """One `nn.ModuleList` of identical blocks on the diffusion model.

    attribute: the ModuleList's attribute name on the diffusion model.
    streams:   the hidden states a block carries from input to output, as (keyword, position) of its call: the
               model may pass them either way.
    returns:   the block's outputs, by stream name, in the order it returns them (one name: a lone tensor).
    cached:    whether the step cache may skip these blocks (False for small refiner stacks that run before the
               main ones: they are compiled, never skipped).
    probe:     the stream whose change the adaptive step cache measures: the image tokens (default: the first
               returned stream). The text tokens change little from step to step, so measured on them nearly every
               step looked reusable.
    parts:     ((stream, (part names)),) for a stream that a block takes and returns as one tuple of tensors (LTX-2's
               (video, audio)): everything above and below sees its parts, by these names, instead.
    options:   the transformer_options entries the blocks read themselves (LTX-2's switches for each stream), passed on
               to compiled blocks, which otherwise get only Overdrive's attention override; with options declared,
               a block always gets a transformer_options dict.
    """
    attribute: str
    streams: tuple
    returns: tuple
    cached: bool = True
    probe: str = ""
    parts: tuple = ()
    options: tuple = ()

    @property
    def probed(self) -> str:
        return self.probe or self.returned[0]

    @property
    def returned(self) -> tuple:
        """The names of what a block returns, a tuple stream's parts in its place."""
        return tuple(self._split(dict.fromkeys(self.returns)))

    def _split(self, values: dict) -> dict:
        """`values` with each tuple stream replaced by its parts (a value that is None stays None in each part)."""
        if not self.parts:
            return values
        out = {}
        for name, value in values.items():
            names = dict(self.parts).get(name)
            out.update({name: value} if names is None
                       else dict(zip(names, value if value is not None else (None,) * len(names))))
        return out

    def carried(self, args: tuple, kwargs: dict) -> dict:
        """The streams of one block call, by name."""
        return self._split({name: kwargs[name] if name in kwargs else args[position]
                            for name, position in self.streams})

    def named(self, out) -> dict:
        """A block's output, by stream name."""
        return self._split(dict(zip(self.returns, out if len(self.returns) > 1 else (out,))))

    def output(self, values: dict):
        """`values` (by stream name) in the block's own output form."""
        parts = dict(self.parts)
        ordered = tuple(tuple(values[part] for part in parts[name]) if name in parts else values[name]
                        for name in self.returns)
        return ordered if len(ordered) > 1 else ordered[0]


@dataclass(frozen=True)
class HostSyncFix:
    """A function of the model's own code that blocks the host on the GPU at every model call (a copy from the CPU,
    `.item()`), replaced wherever Overdrive runs the model by one that computes the same values without blocking. After
    such a call the GPU idles until the host has queued the next work; with one a step, every step pays that.

    module, name: where the model's code looks the function up (every module that imported it by name); a method is
                  named "Class.method" and replaced on its class.
    replacement: the function that takes its place; its output must equal the original's bit for bit (tested).
    probe: arguments both are called with on the CPU before the swap (for a method, an object with the attributes it
           reads first): a ComfyUI whose function computes something else (another version) keeps its own."""
    module: str
    name: str
    replacement: Callable
    why: str
    probe: tuple = ()

    def _owner(self):
        """The module, or the class in it, that holds the function; None where either is missing."""
        owner = sys.modules.get(self.module)
        for part in self.name.split(".")[:-1]:
            owner = getattr(owner, part, None)
        return owner

    @property
    def _attribute(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    def current(self):
        """The function the model's code calls now (the replacement once installed); None where it is missing."""
        return getattr(self._owner(), self._attribute, None)

    def original(self):
        """The model code's own function, installed or not."""
        return _ORIGINALS.get((self.module, self.name), self.current())

    def install(self) -> None:
        """Idempotent; a module not imported yet (its model never loaded) or without the function is left alone."""
        current = self.current()
        if current is None or current is self.replacement or (self.module, self.name, current) in _DECLINED:
            return
        try:
            same = torch.equal(current(*self.probe), self.replacement(*self.probe))
        except Exception as error:  # noqa: BLE001 - another signature: keep the model's own function
            same, why_not = False, f"{type(error).__name__}: {error}"
        else:
            why_not = "its output differs from the replacement's"
        if not same:
            _DECLINED.add((self.module, self.name, current))
            log.warning("Overdrive: %s.%s is not the function its host-sync fix replaces (%s); it stays as it is",
                        self.module, self.name, why_not)
            return
        _ORIGINALS.setdefault((self.module, self.name), current)
        setattr(self._owner(), self._attribute, self.replacement)
        log.info("Overdrive: %s.%s replaced by a version that does not block the host (%s)", self.module, self.name,
                 self.why)

    def uninstall(self) -> None:
        """Puts the original back (benchmarks' A/B)."""
        original = _ORIGINALS.pop((self.module, self.name), None)
        if original is not None:
            setattr(self._owner(), self._attribute, original)


_ORIGINALS: dict = {}  # (module, name) -> the function a fix replaced
_DECLINED: set = set()  # (module, name, function) a fix found different: probed and warned about once


@dataclass(frozen=True)
class Family:
    name: str
    classes: frozenset  # the diffusion model's class names (ComfyUI's; diffusers' where the layout matches)
    stacks: tuple
    # diffusers: the timestep the model's forward takes at pure noise and at a clean image (its pipelines pass Flux
    # and Qwen-Image t / 1000, Wan and SD3 t itself, Z-Image (1000 - t) / 1000); the step cache reads its steps and
    # window in that range (diffusers_api/steps.py). ComfyUI passes sigmas and ignores these.
    noise_timestep: float = 1.0
    clean_timestep: float = 0.0
    # ((pattern, why)): layers that quantization leaves in float (a regular expression matched from the start of the
    # qualified name): the model's own code needs them as they are, or their 8-bit error reaches every block at
    # little gain (bench/probes/fp8_layer_groups.py measures each group's share of a model call's error).
    float_layers: tuple = ()
    # HostSyncFix-es for the family's model code, installed when Overdrive first builds a forward for such a model.
    host_sync_fixes: tuple = ()

    def blocks(self, model: torch.nn.Module) -> list:
        """[(stack, path, block)] of every block in run order."""
        return [(stack, f"{stack.attribute}.{i}", block)
                for stack in self.stacks for i, block in enumerate(getattr(model, stack.attribute))]


def registered() -> tuple:
    """Every family plug-in: ComfyUI's classes, then diffusers'."""
    from . import flux, ltxv, qwen_image, sd3, wan, zimage
    return (tuple(plugin.FAMILY for plugin in (flux, qwen_image, sd3, wan, zimage, ltxv)) + (flux.CHROMA, ltxv.LTX2)
            + (flux.DIFFUSERS, flux.DIFFUSERS_FLUX2, flux.DIFFUSERS_CHROMA, wan.DIFFUSERS, sd3.DIFFUSERS,
               zimage.DIFFUSERS, ltxv.DIFFUSERS))


def family_of(model: torch.nn.Module) -> Family | None:
    """The family plug-in for this diffusion model, or None (the SD UNets are handled by DeepCache's own paths)."""
    name = type(model).__name__
    for family in registered():
        if name in family.classes and all(isinstance(getattr(model, s.attribute, None), torch.nn.ModuleList)
                                          for s in family.stacks):
            return family
    return None

"""What a model family is (`Family`, its `BlockStack`s and `HostSyncFix`es) and the registry its plug-in module adds it
to: one `register(Family(...))` per diffusion-model class layout, looked up by the model's class name (`family_of`)."""
import logging
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..core.registry import Registry

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


class BuiltinModel(NamedTuple):
    """A family's built-in test model: what builtin_models/dit.py needs to write a tiny file of its layout that
    ComfyUI's own detection loads, and to make its conditioning and latents."""
    name: str            # the built-in model's name (file names, Built-in Conditioning's family input)
    model_class: str     # the comfy.supported_models class detection must pick
    full: dict           # the unet_config of the real model, as detection returns it
    tiny: dict           # what "tiny" overrides
    vae: str             # key of VAES
    cond: dict           # conditioning shapes: context (tokens, width), pooled width (None: the key without a
                         # vector), guidance, and the prompt's share of the tokens where the encoder also gives an
                         # attention mask (LTX-Video's T5 pads to 128 tokens and masks the padding; its model
                         # requires the mask)
    latent: dict         # latent channels, the VAE's spatial compression, whether latents have a time axis, and
                         # whether that axis holds a video's frames (Qwen-Image's has one image frame), the VAE's
                         # temporal compression ("temporal", 4 unless given), and ComfyUI's empty-latent node where
                         # Flux's example graph (EmptySD3LatentImage) would give the wrong shape ("node")
    sampling: dict       # CFG and steps as the family is usually sampled (Flux.1-dev and Z-Image Turbo are
                         # guidance-distilled: CFG 1, one model call a step)
    cpu_suite: bool = True  # whether the CPU test suite runs the tiny file (Flux.2's, 2.3 B parameters, is the GPU
                            # tests' alone: tests/test_flux2_gpu.py)
    file_config: tuple = ()  # unet_config keys that detection reads from the file's metadata ({"config":
                             # {"transformer": {...}}}), not from the weights' shapes (LTX-2's audio stream)


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
    # How UI text and logs name the family ("Qwen-Image"); default: `name`.
    display_name: str = ""
    # Compiled whole (compiler.compile_module) under dynamic="auto", one static graph per shape instead of a
    # shape-generic one (measured on ComfyUI 0.7.0, tests/test_dit_families.py): ComfyUI's Flux, Qwen-Image and Wan
    # build their position ids with torch.linspace(steps=<latent size>), which Dynamo specialises anyway, and in
    # Z-Image's shape-generic graph the token padding `(-n) % 32` came out wrong on the CPU. Compile Model compiles
    # them per block (core/blockwise.py), whose blocks are shape-generic.
    static_under_auto: bool = False
    # How sequence parallelism splits its calls (parallel/split_rules.py: SplitFamily for ComfyUI's class,
    # DiffusersSplit for diffusers'); none: it does not split them.
    sequence_splits: tuple = ()
    # BuiltinModel-s: the tiny files of this layout the tests and the main job write (builtin_models/dit.py).
    builtin_models: tuple = ()
    # The step cache's default threshold (mode "auto"): the largest whose images stay 40 dB or more from eager's on the
    # reference model with learned weights of this kind (bench/README.md, fidelity table); image models without one
    # take the MMDiT's.
    step_cache_threshold: float = 0.2
    # ComfyUI's model code gives its attention the video's token grid (transformer_options["grid_sizes"]: frames,
    # height, width), which Sparse Video Attention masks by (attention/video_sparsity.py).
    video_grid: bool = False

    @property
    def title(self) -> str:
        return self.display_name or self.name

    def split_rule(self, kind: type):
        """Its sequence-split rule of type `kind`, or None."""
        return next((rule for rule in self.sequence_splits if isinstance(rule, kind)), None)

    def blocks(self, model: torch.nn.Module) -> list:
        """[(block stack, path, block)] of every block in run order."""
        return [(block_stack, f"{block_stack.attribute}.{i}", block)
                for block_stack in self.stacks for i, block in enumerate(getattr(model, block_stack.attribute))]


FAMILIES = Registry("model family")  # by diffusion-model class name, in registration order


def register(family: Family) -> Family:
    """Adds `family` under each of its class names (its plug-in module calls this when imported) and returns it."""
    for name in sorted(family.classes):
        FAMILIES.register(name, family)
    return family


def registered() -> tuple:
    """Every family, once each, in registration order."""
    out = []
    for family in FAMILIES.values():
        if not any(family is seen for seen in out):
            out.append(family)
    return tuple(out)


def family_titles(keep=None) -> str:
    """What UI text lists: each registered family's display name once, in registration order (those `keep` accepts)."""
    return ", ".join(dict.fromkeys(family.title for family in registered() if keep is None or keep(family)))


def family_of(model: torch.nn.Module) -> Family | None:
    """The family plug-in for this diffusion model, or None (the SD UNets are handled by DeepCache's own paths)."""
    family = FAMILIES.get(type(model).__name__)
    if family is not None and all(isinstance(getattr(model, s.attribute, None), torch.nn.ModuleList)
                                  for s in family.stacks):
        return family
    return None

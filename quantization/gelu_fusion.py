"""A DiT MLP (fc1 -> tanh-GELU -> fc2) whose two projections are static fp8 layers runs fc1, the GELU and fc2's input
cast as one kernel: cuBLASLt's fp8 GEMM with its GELU epilogue writes fc2's e4m3 input (kernels.fp8_linear_gelu),
instead of fc1 writing 16-bit activations that a second kernel reads back (faster per MLP call on Qwen-Image, Wan 2.2
and both of Flux's streams: `bench/probes/fp8_gelu_gemm.py`, `results/2026-11-28_h100_fp8_gelu_gemm.json`).

`fuse(tree, layers, dtype)` links each such pair of quantized layers (Fp8Linear.fuse_gelu_into) and returns the
activation modules' new classes (ComfyUI swaps them in as object patches; `fuse_in_place` sets them, for quantize_):
the same module, whose forward passes an e4m3 input through (fc1 applied GELU already) and computes GELU otherwise, so
the float layers of the same tree, an unlinked pair or another dtype still get their GELU. A class, not a new module:
Qwen-Image's activation module holds fc1 (`.proj`), and swapping the holder would separate it from the quantized
layer ComfyUI swaps in at `….proj`. A tree may still carry these classes (ComfyUI leaves object patches applied after a
run; Switch Diffusion Model copies the tree as it is): they are matched as the classes they stand for.

The MLPs found, in the float model's tree (ComfyUI 0.7 and diffusers):
- nn.Sequential(fc1, nn.GELU("tanh"), [Dropout | Identity]..., fc2): Flux's and Chroma's double blocks, Wan's blocks;
- a container with `proj` and `approximate="tanh"` (proj, then GELU), or LTX's GELU_approx, followed in its
  Sequential / ModuleList by [Dropout | Identity]... and fc2: Qwen-Image's, LTX-Video's, LTX-2's and diffusers'
  FeedForward;
- timm's `Mlp` (fc1, act = nn.GELU("tanh"), dropouts, norm = Identity, fc2): SD3.5's blocks.
Flux's single blocks concatenate the attention's output before their second GEMM, so they have no such pair.

ComfyUI 0.33's Wan and LTX feed-forwards skip their activation module: their forward calls
`comfy.ops.linear_input_act(fc2, fc1(x), "gelu_tanh")`, which applies GELU itself. A fused MLP under such a holder also
gets the holder's class swapped, to one that runs its Sequential in order (the same function at inference), so the
e4m3 output of fc1 meets the pass-through activation rather than a second GELU.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .formats.fp8 import Fp8Linear
from .kernels import FP8_DTYPE

PASS_THROUGH = (nn.Dropout, nn.Identity)  # identities at inference, for any dtype


# Functions of ComfyUI's model code that apply an MLP's activation themselves, bypassing its module.
ACTIVATION_BYPASSES = ("linear_input_act",)


@dataclasses.dataclass(frozen=True)
class GeluMlp:
    fc1: str         # the quantized layers' names in the tree
    fc2: str
    activation: str  # the module that applies GELU (holding fc1 as `proj`, or a bare nn.GELU)
    holder: str | None = None  # a module whose forward bypasses the activation (ACTIVATION_BYPASSES), or None
    sequence: str = ""         # the holder's Sequential that holds the MLP ("": the holder itself)


class GeluUnlessFused(nn.GELU):
    """nn.GELU that passes an e4m3 input through: that input is a fused first layer's output, GELU applied."""

    fused_from = nn.GELU

    def forward(self, x):
        return x if x.dtype == FP8_DTYPE else super().forward(x)


def _projection_then_gelu(self, x):
    h = self.proj(x)  # LTX's GELU_approx has no `approximate`: its forward is tanh-GELU
    return h if h.dtype == FP8_DTYPE else F.gelu(h, approximate=getattr(self, "approximate", "tanh"))


@functools.lru_cache(maxsize=None)
def projection_unless_fused(cls: type) -> type:
    """`cls` (proj, then tanh-GELU) with a forward that passes an e4m3 projection through."""
    return type(f"{cls.__name__}UnlessFused", (cls,), {"forward": _projection_then_gelu, "__module__": __name__,
                                                       "fused_from": cls,
                                                       "__doc__": f"{cls.__name__}, passing a fused proj's e4m3 "
                                                                  f"output through."})


def _run_in_order(self, x):
    sequence = self.get_submodule(self.overdrive_sequence) if self.overdrive_sequence else self
    for layer in sequence:
        x = layer(x)
    return x


@functools.lru_cache(maxsize=None)
def runs_in_order(cls: type, sequence: str) -> type:
    """`cls` (whose forward bypasses its MLP's activation) with a forward that runs its Sequential `sequence` layer by
    layer, activation included."""
    return type(f"{cls.__name__}InOrder", (cls,), {"forward": _run_in_order, "__module__": __name__,
                                                   "fused_from": cls, "overdrive_sequence": sequence,
                                                   "__doc__": f"{cls.__name__}, running its layers in order."})


def _bypasses_activation(module) -> bool:
    forward = getattr(_original_class(module), "forward", None)
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    return any(name in names for name in ACTIVATION_BYPASSES)


def _holder(tree: nn.Module, name: str, module: nn.Module) -> tuple:
    """(holder's name, its Sequential's name relative to it) where `module` (at `name`) or its parent bypasses the
    activation; (None, "") otherwise."""
    if _bypasses_activation(module):
        return name, ""
    parent_name, _, attribute = name.rpartition(".")
    if name and _bypasses_activation(tree.get_submodule(parent_name) if parent_name else tree):
        return parent_name, attribute
    return None, ""


def _original_class(module) -> type:
    return getattr(type(module), "fused_from", type(module))


def unlink(layer: nn.Module) -> None:
    """A copy of a quantized layer out of the MLP pair `fuse` linked it into (its own pair is fused anew, or not)."""
    if isinstance(layer, Fp8Linear):
        layer.gelu_dtype, layer.gelu_output_scale_inverse, layer.e4m3_input_dtype = None, None, None


def restore_class(module: nn.Module) -> None:
    """Give a module `fuse` swapped a class for its own class back (any other module is left as it is)."""
    module.__class__ = _original_class(module)


def _tanh_gelu(module) -> bool:
    return _original_class(module) is nn.GELU and module.approximate == "tanh"


def _projection_gelu(module) -> bool:
    cls = _original_class(module)
    tanh = getattr(module, "approximate", None) == "tanh" or cls.__name__ == "GELU_approx"
    return set(module._modules) == {"proj"} and tanh and "forward" in cls.__dict__


def _next_layer(children: list, start: int) -> str | None:
    """The first child from `start` that is not a pass-through, or None."""
    for name, child in children[start:]:
        if not isinstance(child, PASS_THROUGH):
            return name
    return None


def gelu_mlps(tree: nn.Module) -> list:
    """Every fc1 -> tanh-GELU -> fc2 of `tree` (the patterns above), whatever its layers are."""
    found = []
    for name, module in tree.named_modules():
        prefix = f"{name}." if name else ""
        children = list(module.named_children())
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            for i, (child_name, child) in enumerate(children):
                if _tanh_gelu(child) and isinstance(module, nn.Sequential) and i > 0:
                    fc1 = children[i - 1][0]
                elif _projection_gelu(child):
                    fc1 = f"{child_name}.proj"
                else:
                    continue
                fc2 = _next_layer(children, i + 1)
                if fc2 is not None:
                    holder, sequence = _holder(tree, name, module)
                    found.append(GeluMlp(prefix + fc1, prefix + fc2, prefix + child_name, holder, sequence))
        elif type(module).__name__ == "Mlp" and {"fc1", "act", "fc2"} <= set(module._modules) \
                and _tanh_gelu(module.act) and all(isinstance(child, PASS_THROUGH) for child_name, child in children
                                                    if child_name not in ("fc1", "act", "fc2")):
            found.append(GeluMlp(prefix + "fc1", prefix + "fc2", prefix + "act"))
    return found


def _fusable(fc1, fc2) -> bool:
    # An Fp8Linear's K and N are multiples of 16 already (the format's shape rule), as cuBLASLt wants them.
    return (type(fc1) is Fp8Linear and type(fc2) is Fp8Linear and fc1.static_input and fc2.static_input
            and fc1.out_features == fc2.in_features)


def fuse(tree: nn.Module, layers: dict, dtype: torch.dtype) -> dict:
    """Link each MLP of `tree` whose fc1 and fc2 are static fp8 layers in `layers` (name -> quantized layer) for
    inputs of `dtype`; returns {activation module's name: the class to give it}."""
    classes = {}
    for mlp in gelu_mlps(tree):
        fc1, fc2 = layers.get(mlp.fc1), layers.get(mlp.fc2)
        if not _fusable(fc1, fc2):
            continue
        fc1.fuse_gelu_into(fc2, dtype)
        activation = tree.get_submodule(mlp.activation)
        classes[mlp.activation] = GeluUnlessFused if _tanh_gelu(activation) else \
            projection_unless_fused(_original_class(activation))
        if mlp.holder is not None:
            classes[mlp.holder] = runs_in_order(_original_class(tree.get_submodule(mlp.holder)), mlp.sequence)
    return classes


def mlp_count(classes: dict) -> int:
    """How many MLPs `fuse`'s classes link (a holder's class comes beside its MLP's activation)."""
    return sum(not hasattr(cls, "overdrive_sequence") for cls in classes.values())


def fuse_in_place(tree: nn.Module, layers: dict, dtype: torch.dtype) -> int:
    """`fuse` on a tree whose quantized layers are swapped in: the activations' classes set; returns how many MLPs."""
    classes = fuse(tree, layers, dtype)
    for name, cls in classes.items():
        tree.get_submodule(name).__class__ = cls
    return mlp_count(classes)

"""How sequence parallelism reads a family's model classes, declared in the family's own module (families/): the
block-replacement layout of ComfyUI's classes (`SplitFamily`, comfy_host/sequence_split.py) and the call layout of
diffusers' (`DiffusersSplit`, diffusers_api/sequence_split.py)."""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class SplitFamily:
    """How sequence parallelism reads one family of ComfyUI's diffusion models."""
    blocks: Callable  # model -> its block-replacement keys, in the order a call runs them
    heads: Callable  # model -> attention heads
    patch: Callable  # model -> (frames, height, width) of a patch
    joint: bool  # the text joins the image tokens in the blocks' attention
    pe_dim: int | None  # where the rotary frequencies hold their tokens (text first in joint families)
    vec_per_token: bool = False  # the modulation may come per token (Wan 2.2)


def double_blocks(blocks) -> list:
    return [("double_block", i) for i in range(len(blocks))]


def flux_blocks(model) -> list:
    return double_blocks(model.double_blocks) + [("single_block", i) for i in range(len(model.single_blocks))]


def square(model) -> tuple:
    return (1, model.patch_size, model.patch_size)


@dataclasses.dataclass(frozen=True)
class PerToken:
    """A block argument that holds a value per image token: `dim` indexes its tokens (after the text's where `text`),
    `part` picks one tensor of a tuple argument (None: the argument itself, or each tensor of its tuple)."""
    name: str
    dim: int
    part: int | None = None
    text: bool = False


@dataclasses.dataclass(frozen=True)
class DiffusersSplit:
    """How sequence parallelism reads one diffusers transformer class."""
    tokens: Callable  # (module, hidden_states) -> image tokens of the call
    text_first: bool | None  # where the text sits in its joint attention (None: a cross-attention of its own)
    per_token: tuple = ()


def packed(module, hidden_states) -> int:  # the latent comes as tokens already
    return hidden_states.shape[1]


def patches(module, hidden_states) -> int:
    patch = module.config.patch_size
    patch = (1, patch, patch) if isinstance(patch, int) else tuple(patch)
    frames = hidden_states.shape[2] if hidden_states.ndim == 5 else 1
    return (frames // patch[0]) * (hidden_states.shape[-2] // patch[1]) * (hidden_states.shape[-1] // patch[2])

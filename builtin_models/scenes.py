"""Procedural scenes for the reference models with learned weights: one shape on a background, described by a few
words, rendered in plain torch, the same for a given seed on every machine.

A scene is an image (or a short clip, its shape moving) and its prompt, a word per attribute:
"large red circle striped top-left on-dark" (size, colour, shape, texture, position, background; a clip adds a motion
word). The words are the models' whole language: `embed` turns them into text-encoder-shaped conditioning, one
fixed vector per word, so Built-in Conditioning can hand a trained model the prompt it was trained on without a text
encoder.
"""
from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from ..core.errors import OverdriveError

SIZES = {"small": 0.16, "large": 0.28}  # radius, a fraction of the image side
COLOURS = {"red": (0.90, 0.15, 0.10), "green": (0.15, 0.75, 0.20), "blue": (0.15, 0.30, 0.90),
           "yellow": (0.95, 0.85, 0.10), "purple": (0.60, 0.20, 0.75), "white": (0.95, 0.95, 0.95)}
SHAPES = ("circle", "square", "triangle", "diamond")
TEXTURES = ("plain", "striped", "dotted")
POSITIONS = {f"{row}-{column}": (x, y) for row, y in (("top", 0.3), ("middle", 0.5), ("bottom", 0.7))
             for column, x in (("left", 0.3), ("centre", 0.5), ("right", 0.7))}
BACKGROUNDS = {"on-dark": (0.08, 0.09, 0.12), "on-light": (0.80, 0.78, 0.72)}
MOTIONS = {"still": (0.0, 0.0), "moving-left": (-1.0, 0.0), "moving-right": (1.0, 0.0), "moving-up": (0.0, -1.0),
           "moving-down": (0.0, 1.0)}
TOKENS = 8  # text tokens the reference models read: a token per word (at most 7), then padding
TRAVEL = 0.25  # how far a moving shape goes over a clip, a fraction of the image side
# The attributes in prompt order, each with its words.
ATTRIBUTES = {"size": tuple(SIZES), "colour": tuple(COLOURS), "shape": SHAPES, "texture": TEXTURES,
              "position": tuple(POSITIONS), "background": tuple(BACKGROUNDS), "motion": tuple(MOTIONS)}
WORDS = {word: attribute for attribute, words in ATTRIBUTES.items() for word in words}


class SceneError(OverdriveError, ValueError):
    """A prompt the reference models cannot read: the message names the word and the words there are."""


@dataclasses.dataclass(frozen=True)
class Scene:
    size: str = "large"
    colour: str = "red"
    shape: str = "circle"
    texture: str = "plain"
    position: str = "middle-centre"
    background: str = "on-dark"
    motion: str = "still"

    def prompt(self, video: bool = False) -> str:
        names = [name for name in ATTRIBUTES if video or name != "motion"]
        return " ".join(getattr(self, name) for name in names)


def parse(prompt: str) -> Scene:
    """The scene a prompt names; attributes it leaves out keep Scene's defaults."""
    values = {}
    for word in prompt.lower().split():
        attribute = WORDS.get(word)
        if attribute is None:
            raise SceneError(f"the reference models do not know the word {word!r}; their words are: "
                             + "; ".join(f"{name}: {', '.join(words)}" for name, words in ATTRIBUTES.items()))
        if attribute in values:
            raise SceneError(f"the prompt names the {attribute} twice ({values[attribute]!r} and {word!r}): give one")
        values[attribute] = word
    return Scene(**values)


def random_scene(generator: torch.Generator, video: bool = False) -> Scene:
    def pick(words):
        return words[int(torch.randint(len(words), (), generator=generator))]
    return Scene(**{name: pick(words) if video or name != "motion" else "still" for name, words in ATTRIBUTES.items()})


def _distance(shape: str, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """How far inside (negative) or outside (positive) the unit shape each offset is, in radii."""
    if shape == "circle":
        return torch.sqrt(dx * dx + dy * dy) - 1.0
    if shape == "square":
        return torch.maximum(dx.abs(), dy.abs()) - 0.8
    if shape == "diamond":
        return dx.abs() + dy.abs() - 1.1
    # An upward equilateral triangle: the largest of its three edges' signed distances.
    return torch.maximum(dy - 0.5, torch.maximum(-dy * 0.5 + dx * math.sqrt(3) / 2, -dy * 0.5 - dx * math.sqrt(3) / 2)
                         - 0.5)


def render(scene: Scene, size: int = 64, frames: int = 1) -> torch.Tensor:
    """RGB in [-1, 1], as a VAE encodes pixels: (3, size, size), or (3, frames, size, size) for a clip whose shape
    travels TRAVEL of the side in its motion's direction. Edges are antialiased over one pixel."""
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    radius, (cx, cy) = SIZES[scene.size], POSITIONS[scene.position]
    (mx, my), background = MOTIONS[scene.motion], torch.tensor(BACKGROUNDS[scene.background])
    colour = torch.tensor(COLOURS[scene.colour])
    clips = []
    for frame in range(frames):
        progress = frame / max(frames - 1, 1) - 0.5  # the clip's middle frame is the still scene
        dx, dy = (x - cx - mx * TRAVEL * progress) / radius, (y - cy - my * TRAVEL * progress) / radius
        coverage = (0.5 - _distance(scene.shape, dx, dy) * radius * size).clamp(0.0, 1.0)
        shade = torch.ones_like(x)
        if scene.texture == "striped":  # diagonal stripes, darker
            shade = torch.where(torch.sin((dx + dy) * 6.0) > 0, 1.0, 0.55)
        elif scene.texture == "dotted":
            shade = torch.where(torch.cos(dx * 7.0) * torch.cos(dy * 7.0) > 0.35, 0.45, 1.0)
        image = background[:, None, None] * (1 - coverage) + (colour[:, None, None] * shade) * coverage
        clips.append(image * 2 - 1)
    return clips[0] if frames == 1 else torch.stack(clips, dim=1)


def word_vector(word: str, width: int) -> torch.Tensor:
    """The fixed embedding of a word at a text width: seeded by the word itself, unit variance per channel."""
    return torch.randn(width, generator=torch.Generator().manual_seed(zlib.crc32(f"{word}/{width}".encode())))


def embed(prompt: str, width: int, tokens: int, video: bool = False) -> torch.Tensor:
    """(1, tokens, width): a token per attribute of the prompt's scene in prompt order, then zeros (padding). The
    empty prompt is all zeros: the unconditional input the models were trained with for classifier-free guidance."""
    words = parse(prompt).prompt(video).split() if prompt.strip() else []
    if tokens < len(words):
        raise SceneError(f"{tokens} tokens cannot hold the {len(words)} words of a scene")
    out = torch.zeros(1, tokens, width)
    for position, word in enumerate(words):
        out[0, position] = word_vector(word, width)
    return out


def pooled(prompt: str, width: int, video: bool = False) -> torch.Tensor:
    """(1, width): the mean of the prompt's word vectors, where a family's encoder also gives a pooled vector."""
    words = parse(prompt).prompt(video).split()
    return torch.stack([word_vector(word, width) for word in words]).mean(0, keepdim=True)

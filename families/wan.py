"""Wan 2.1 / 2.2 (ComfyUI's `WanModel`): one stack of attention blocks over the video tokens."""
from . import Family, Stack

FAMILY = Family("wan", frozenset({"WanModel"}), (
    Stack("blocks", streams=(("x", 0),), returns=("x",)),
))

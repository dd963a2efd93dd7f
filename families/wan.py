"""Wan 2.1 / 2.2 (ComfyUI's `WanModel`, diffusers' `WanTransformer3DModel`): one stack of attention blocks over the
video tokens."""
from . import Family, Stack

FAMILY = Family("wan", frozenset({"WanModel"}), (
    Stack("blocks", streams=(("x", 0),), returns=("x",)),
))

DIFFUSERS = Family("wan", frozenset({"WanTransformer3DModel"}), (
    Stack("blocks", streams=(("hidden_states", 0),), returns=("hidden_states",)),
), noise_timestep=1000.0)

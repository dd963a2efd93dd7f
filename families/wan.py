"""Wan 2.1 / 2.2 (ComfyUI's `WanModel`, diffusers' `WanTransformer3DModel`): one stack of attention blocks over the
video tokens."""
from . import Family, Stack

FAMILY = Family("wan", frozenset({"WanModel"}), (
    Stack("blocks", streams=(("x", 0),), returns=("x",)),
))

DIFFUSERS = Family("wan", frozenset({"WanTransformer3DModel"}), (
    Stack("blocks", streams=(("hidden_states", 0),), returns=("hidden_states",)),
), noise_timestep=1000.0, float_layers=(
    # diffusers' Wan casts the timestep to `next(time_embedder.parameters()).dtype`: with both its linears quantized
    # (whose weights are buffers) that raises StopIteration. Two GEMVs a call: nothing to gain from 8 bits.
    ("condition_embedder.time_embedder.", "diffusers' Wan reads the float dtype from this module's parameters"),
))

"""Flux.1 (ComfyUI's `Flux`; Flux 2 shares the class) and Chroma (ComfyUI's `Chroma`, Flux.1-schnell's blocks with
their modulations made once by one approximator): 19 double-stream blocks over image and text tokens, then 38
single-stream blocks over their concatenation. Chroma calls its double blocks by keyword, which a Stack's streams
allow. diffusers' `FluxTransformer2DModel` has the same blocks under its own names; its single blocks take and return
both streams (they concatenate inside)."""
from . import Family, Stack

FAMILY = Family("flux", frozenset({"Flux"}), (
    Stack("double_blocks", streams=(("img", 0), ("txt", 1)), returns=("img", "txt")),
    Stack("single_blocks", streams=(("x", 0),), returns=("x",)),
))

CHROMA = Family("chroma", frozenset({"Chroma"}), FAMILY.stacks)

DIFFUSERS = Family("flux", frozenset({"FluxTransformer2DModel"}), (
    Stack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
    Stack("single_transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
))

"""Flux.1 (ComfyUI's `Flux`; Chroma and Flux 2 share the block layout): 19 double-stream blocks over image and text
tokens, then 38 single-stream blocks over their concatenation."""
from . import Family, Stack

FAMILY = Family("flux", frozenset({"Flux"}), (
    Stack("double_blocks", streams=(("img", 0), ("txt", 1)), returns=("img", "txt")),
    Stack("single_blocks", streams=(("x", 0),), returns=("x",)),
))

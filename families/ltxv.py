"""LTX-Video (ComfyUI's `LTXVModel`, Lightricks' 2B and 13B video DiTs): one stack of attention blocks over the video
tokens, each a self-attention, a cross-attention over the T5 prompt and a gated MLP; a block updates its input in
place and returns it. LTX-2 (`LTXAVModel`, audio and video) passes both streams to its blocks as one tuple, which a
Stack does not describe: it runs without this plug-in (whole-model compile, no step cache)."""
from . import Family, Stack

FAMILY = Family("ltxv", frozenset({"LTXVModel"}), (
    Stack("transformer_blocks", streams=(("x", 0),), returns=("x",)),
))

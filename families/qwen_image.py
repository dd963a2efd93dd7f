"""Qwen-Image (ComfyUI's `QwenImageTransformer2DModel`, and diffusers' class of that name, whose blocks have the same
names and calls): 60 dual-stream blocks; each returns (text, image)."""
from . import Family, BlockStack

FAMILY = Family("qwen_image", frozenset({"QwenImageTransformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
))

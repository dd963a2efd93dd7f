"""Qwen-Image (ComfyUI's `QwenImageTransformer2DModel`, and diffusers' class of that name, whose blocks have the same
names and calls): 60 dual-stream blocks; each returns (text, image)."""
from ..parallel.split_rules import DiffusersSplit, PerToken, SplitFamily, double_blocks, packed, square
from .family import BlockStack, BuiltinModel, Family, register

# The built-in test models of this layout (tiny files written by builtin_models/dit.py).
BUILTIN = BuiltinModel(
    "qwen_image",
    "QwenImage", dict(image_model="qwen_image", in_channels=64, num_layers=60), dict(num_layers=2),
    "wan21", dict(tokens=64, width=3584), dict(channels=16, spatial=8, frames=True, video=False),  # Wan 2.1 VAE
    dict(cfg=2.5, steps=20))

FAMILY = register(Family("qwen_image", frozenset({"QwenImageTransformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
), display_name="Qwen-Image", static_under_auto=True, builtin_models=(BUILTIN,), sequence_splits=(
    SplitFamily(lambda m: double_blocks(m.transformer_blocks), lambda m: m.transformer_blocks[0].attn.heads, square,
                joint=True, pe_dim=2),
    DiffusersSplit(packed, text_first=True, per_token=(PerToken("image_rotary_emb", 0, part=0),
                                                       PerToken("modulate_index", 1))),
)))

"""Qwen-Image (ComfyUI's `QwenImageTransformer2DModel`, and diffusers' class of that name, whose blocks have the same
names and calls): 60 dual-stream blocks; each returns (text, image)."""
from ..parallel.split_rules import DiffusersSplit, PerToken, SplitFamily, double_blocks, packed, square
from .family import BlockStack, Family, register

FAMILY = register(Family("qwen_image", frozenset({"QwenImageTransformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
), display_name="Qwen-Image", static_under_auto=True, sequence_splits=(
    SplitFamily(lambda m: double_blocks(m.transformer_blocks), lambda m: m.transformer_blocks[0].attn.heads, square,
                joint=True, pe_dim=2),
    DiffusersSplit(packed, text_first=True, per_token=(PerToken("image_rotary_emb", 0, part=0),
                                                       PerToken("modulate_index", 1))),
)))

"""SD3 / SD3.5 (ComfyUI's `OpenAISignatureMMDITWrapper`, diffusers' `SD3Transformer2DModel`): joint blocks over
(context, x); the last block's context output is None (it is "pre-only")."""
from ..parallel.split_rules import DiffusersSplit, SplitFamily, double_blocks, patches, square
from .family import BlockStack, Family, register

FAMILY = register(Family("sd3", frozenset({"OpenAISignatureMMDITWrapper"}), (
    BlockStack("joint_blocks", streams=(("context", 0), ("x", 1)), returns=("context", "x"), probe="x"),
), display_name="SD3", sequence_splits=(
    SplitFamily(lambda m: double_blocks(m.joint_blocks), lambda m: m.joint_blocks[0].x_block.attn.num_heads, square,
                joint=True, pe_dim=None),)))

DIFFUSERS = register(Family("sd3", frozenset({"SD3Transformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
), noise_timestep=1000.0, display_name="SD3", sequence_splits=(DiffusersSplit(patches, text_first=False),)))

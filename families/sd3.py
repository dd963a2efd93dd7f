"""SD3 / SD3.5 (ComfyUI's `OpenAISignatureMMDITWrapper`, diffusers' `SD3Transformer2DModel`): joint blocks over
(context, x); the last block's context output is None (it is "pre-only")."""
from ..parallel.split_rules import DiffusersSplit, SplitFamily, double_blocks, patches, square
from .family import BlockStack, BuiltinModel, Family, register

# The built-in test models of this layout (tiny files written by builtin_models/dit.py).
BUILTIN = BuiltinModel(  # SD3.5 Large: 38 joint blocks of 64 x 38 channels
    "sd35",
    "SD3",
    dict(in_channels=16, patch_size=2, out_channels=16, depth=38, input_size=None, adm_in_channels=2048,
         context_embedder_config={"target": "torch.nn.Linear",
                                  "params": {"in_features": 4096, "out_features": 2432}},
         num_patches=36864, pos_embed_max_size=192, qk_norm="rms", pos_embed_scaling_factor=None,
         x_block_self_attn_layers=[]),
    dict(depth=2, context_embedder_config={"target": "torch.nn.Linear",
                                           "params": {"in_features": 4096, "out_features": 128}},
         num_patches=1024, pos_embed_max_size=32),
    "flux_ae", dict(tokens=154, width=4096, pooled=2048), dict(channels=16, spatial=8, frames=False),
    dict(cfg=4.5, steps=20))

FAMILY = register(Family("sd3", frozenset({"OpenAISignatureMMDITWrapper"}), (
    BlockStack("joint_blocks", streams=(("context", 0), ("x", 1)), returns=("context", "x"), probe="x"),
), display_name="SD3", builtin_models=(BUILTIN,), sequence_splits=(
    SplitFamily(lambda m: double_blocks(m.joint_blocks), lambda m: m.joint_blocks[0].x_block.attn.num_heads, square,
                joint=True, pe_dim=None),)))

DIFFUSERS = register(Family("sd3", frozenset({"SD3Transformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
), noise_timestep=1000.0, display_name="SD3", sequence_splits=(DiffusersSplit(patches, text_first=False),)))

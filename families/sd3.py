"""SD3 / SD3.5 (ComfyUI's `OpenAISignatureMMDITWrapper`, diffusers' `SD3Transformer2DModel`): joint blocks over
(context, x); the last block's context output is None (it is "pre-only")."""
from . import Family, BlockStack

FAMILY = Family("sd3", frozenset({"OpenAISignatureMMDITWrapper"}), (
    BlockStack("joint_blocks", streams=(("context", 0), ("x", 1)), returns=("context", "x"), probe="x"),
))

DIFFUSERS = Family("sd3", frozenset({"SD3Transformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
), noise_timestep=1000.0)

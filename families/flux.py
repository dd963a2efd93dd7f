"""Flux.1 (ComfyUI's `Flux`; Flux 2 shares the class) and Chroma (ComfyUI's `Chroma`, Flux.1-schnell's blocks with
their modulations made once by one approximator): 19 double-stream blocks over image and text tokens, then 38
single-stream blocks over their concatenation. Chroma calls its double blocks by keyword, which a BlockStack's streams
allow. diffusers' `FluxTransformer2DModel` has the same blocks under its own names; its single blocks take and return
both streams (they concatenate inside). diffusers' Flux.2 and Chroma pass their single blocks the streams already
concatenated."""
from ..parallel.split_rules import DiffusersSplit, PerToken, SplitFamily, flux_blocks, packed, square
from .family import BlockStack, BuiltinModel, Family, register

# The built-in test models of this layout (tiny files written by builtin_models/dit.py).
BUILTIN_FLUX = BuiltinModel(
    "flux",
    "Flux",
    dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
         hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=19, depth_single_blocks=38, axes_dim=[16, 56, 56],
         theta=10000, qkv_bias=True, guidance_embed=True, patch_size=2, txt_ids_dims=[], yak_mlp=False,
         txt_norm=False),
    dict(depth=1, depth_single_blocks=1),
    "flux_ae", dict(tokens=256, width=4096, pooled=768, guidance=3.5), dict(channels=16, spatial=8, frames=False),
    dict(cfg=1.0, steps=20))

BUILTIN_CHROMA = BuiltinModel(  # Chroma1 (Flux.1-schnell's blocks without per-block modulation layers: one approximator
    # makes every block's modulation from the timestep), T5-XXL only and unpadded, sampled with real CFG
    "chroma",
    "Chroma",
    dict(image_model="chroma", in_channels=64, out_channels=64, in_dim=64, out_dim=3072, hidden_dim=5120,
         n_layers=5, hidden_size=3072, context_in_dim=4096, mlp_ratio=4.0, num_heads=24, depth=19,
         depth_single_blocks=38, axes_dim=[16, 56, 56], theta=10000, qkv_bias=True, patch_size=2,
         txt_ids_dims=[], vec_in_dim=None),
    dict(depth=1, depth_single_blocks=1),
    "flux_ae", dict(tokens=64, width=4096, pooled=None), dict(channels=16, spatial=8, frames=False),
    dict(cfg=4.0, steps=26))

BUILTIN_FLUX2 = BuiltinModel(  # Flux.2 [dev] (32 B): 8 double and 48 single blocks at 48 heads x 128, their modulations
    # made once per call by three global layers; Mistral Small 3.1's three stacked hidden layers as the text (15,360
    # wide, padded to 512 tokens by ComfyUI); guidance-distilled. Detection fixes the heads and the rotary axes,
    # so the width stays 6,144 and the tiny file is one block of each kind (2.3 B parameters)
    "flux2",
    "Flux2",
    dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=15360,
         hidden_size=6144, mlp_ratio=3.0, num_heads=48, depth=8, depth_single_blocks=48, axes_dim=[32, 32, 32, 32],
         theta=2000, qkv_bias=False, guidance_embed=True, patch_size=1, txt_ids_dims=[3], yak_mlp=False,
         txt_norm=False, global_modulation=True, mlp_silu_act=True, ops_bias=False, default_ref_method="index",
         ref_index_scale=10.0),
    dict(depth=1, depth_single_blocks=1),
    "flux2_ae", dict(tokens=512, width=15360, pooled=None, guidance=4.0),
    dict(channels=128, spatial=16, frames=False, node="EmptyFlux2LatentImage"),
    dict(cfg=1.0, steps=28), cpu_suite=False)

FAMILY = register(Family("flux", frozenset({"Flux"}), (
    BlockStack("double_blocks", streams=(("img", 0), ("txt", 1)), returns=("img", "txt")),
    BlockStack("single_blocks", streams=(("x", 0),), returns=("x",)),
), display_name="Flux", static_under_auto=True, builtin_models=(BUILTIN_FLUX, BUILTIN_FLUX2), sequence_splits=(
    SplitFamily(flux_blocks, lambda m: m.params.num_heads, square, joint=True, pe_dim=2),)))

CHROMA = register(Family("chroma", frozenset({"Chroma"}), FAMILY.stacks, display_name="Chroma", builtin_models=(BUILTIN_CHROMA,), float_layers=(
    # fp8 with QuantizeModel's defaults: most of a model call's error against bf16 comes from these layers alone
    # (bench/results/2026-11-27_h100_chroma_fp8_layer_groups.json). They run on a few hundred rows once a call: in bf16
    # fp8 ran as fast as with them in 8 bits (..._chroma_1024_float_approximator.json, ..._chroma_1024.json).
    (r"distilled_guidance_layer\.", "Chroma's approximator makes every block's modulation: its 8-bit error reaches "
                                    "all 57 blocks"),
)))

DIFFUSERS = register(Family("flux", frozenset({"FluxTransformer2DModel"}), (
    BlockStack("transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
    BlockStack("single_transformer_blocks", streams=(("hidden_states", 0), ("encoder_hidden_states", 1)),
          returns=("encoder_hidden_states", "hidden_states"), probe="hidden_states"),
), display_name="Flux", sequence_splits=(
    DiffusersSplit(packed, text_first=True, per_token=(PerToken("image_rotary_emb", 0, text=True),)),)))

# diffusers' Flux.2: the double blocks return both streams; the single blocks take the streams concatenated (their text
# tokens included), the modulations of three global layers passed to every block.
DIFFUSERS_FLUX2 = register(Family("flux2", frozenset({"Flux2Transformer2DModel"}), (
    DIFFUSERS.stacks[0],
    BlockStack("single_transformer_blocks", streams=(("hidden_states", 0),), returns=("hidden_states",)),
), display_name="Flux.2"))

# diffusers' Chroma: Flux.2's stack layout over Flux.1's blocks, and the same approximator as ComfyUI's (CHROMA).
DIFFUSERS_CHROMA = register(Family("chroma", frozenset({"ChromaTransformer2DModel"}), DIFFUSERS_FLUX2.stacks,
                                   float_layers=CHROMA.float_layers, display_name="Chroma"))

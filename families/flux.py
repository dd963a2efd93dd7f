"""Flux.1 (ComfyUI's `Flux`; Flux 2 shares the class) and Chroma (ComfyUI's `Chroma`, Flux.1-schnell's blocks with
their modulations made once by one approximator): 19 double-stream blocks over image and text tokens, then 38
single-stream blocks over their concatenation. Chroma calls its double blocks by keyword, which a BlockStack's streams
allow. diffusers' `FluxTransformer2DModel` has the same blocks under its own names; its single blocks take and return
both streams (they concatenate inside). diffusers' Flux.2 and Chroma pass their single blocks the streams already
concatenated."""
from ..parallel.split_rules import DiffusersSplit, PerToken, SplitFamily, flux_blocks, packed, square
from .family import BlockStack, Family, register

FAMILY = register(Family("flux", frozenset({"Flux"}), (
    BlockStack("double_blocks", streams=(("img", 0), ("txt", 1)), returns=("img", "txt")),
    BlockStack("single_blocks", streams=(("x", 0),), returns=("x",)),
), display_name="Flux", static_under_auto=True, sequence_splits=(
    SplitFamily(flux_blocks, lambda m: m.params.num_heads, square, joint=True, pe_dim=2),)))

CHROMA = register(Family("chroma", frozenset({"Chroma"}), FAMILY.stacks, display_name="Chroma", float_layers=(
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

"""Z-Image (ComfyUI's `NextDiT`, Lumina 2's class; diffusers' `ZImageTransformer2DModel`): two small refiner stacks
(image tokens, caption tokens) run before the main layers over both; the refiners are compiled, never skipped.
diffusers' pipeline passes the timestep rising, (1000 - t) / 1000: 0 at pure noise."""
from .family import BlockStack, BuiltinModel, Family, register

# The built-in test models of this layout (tiny files written by builtin_models/dit.py).
BUILTIN = BuiltinModel(
    "zimage",
    "ZImage",
    dict(image_model="lumina2", patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560, n_layers=30,
         qk_norm=True, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
         rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
         pad_tokens_multiple=32),
    dict(n_layers=2),
    "flux_ae", dict(tokens=64, width=2560), dict(channels=16, spatial=8, frames=False),
    dict(cfg=1.0, steps=8))

FAMILY = register(Family("zimage", frozenset({"NextDiT"}), (
    BlockStack("noise_refiner", streams=(("x", 0),), returns=("x",), cached=False),
    BlockStack("context_refiner", streams=(("x", 0),), returns=("x",), cached=False),
    BlockStack("layers", streams=(("x", 0),), returns=("x",)),
), display_name="Z-Image", static_under_auto=True, builtin_models=(BUILTIN,)))

DIFFUSERS = register(Family("zimage", frozenset({"ZImageTransformer2DModel"}), FAMILY.stacks, noise_timestep=0.0,
                            clean_timestep=1.0, display_name="Z-Image"))

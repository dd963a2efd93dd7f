"""Z-Image (ComfyUI's `NextDiT`, Lumina 2's class; diffusers' `ZImageTransformer2DModel`): two small refiner stacks
(image tokens, caption tokens) run before the main layers over both; the refiners are compiled, never skipped.
diffusers' pipeline passes the timestep rising, (1000 - t) / 1000: 0 at pure noise."""
from .family import BlockStack, Family, register

FAMILY = register(Family("zimage", frozenset({"NextDiT"}), (
    BlockStack("noise_refiner", streams=(("x", 0),), returns=("x",), cached=False),
    BlockStack("context_refiner", streams=(("x", 0),), returns=("x",), cached=False),
    BlockStack("layers", streams=(("x", 0),), returns=("x",)),
), display_name="Z-Image", static_under_auto=True))

DIFFUSERS = register(Family("zimage", frozenset({"ZImageTransformer2DModel"}), FAMILY.stacks, noise_timestep=0.0,
                            clean_timestep=1.0, display_name="Z-Image"))

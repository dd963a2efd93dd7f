"""Z-Image (ComfyUI's `NextDiT`, Lumina 2's class): two small refiner stacks (image tokens, caption tokens) run
before the main layers over both; the refiners are compiled, never skipped."""
from . import Family, Stack

FAMILY = Family("zimage", frozenset({"NextDiT"}), (
    Stack("noise_refiner", streams=(("x", 0),), returns=("x",), cached=False),
    Stack("context_refiner", streams=(("x", 0),), returns=("x",), cached=False),
    Stack("layers", streams=(("x", 0),), returns=("x",)),
))

"""Built-in Conditioning: prompt conditioning for Overdrive's built-in random-weight DiT models, so their workflows
run without downloading text encoders (ComfyUI builds those at full size only: T5-XXL alone is 9 GB)."""
from ..builtin_models.dit import FAMILIES, conditioning


class OverdriveBuiltinConditioning:
    DESCRIPTION = ("Fixed-seed random conditioning in the shape a family's text encoders produce (Flux: T5-XXL tokens "
                   "and a CLIP-L pooled vector; Flux.2: Mistral Small 3.1's stacked hidden layers; Chroma: T5-XXL; "
                   "Qwen-Image: Qwen2.5-VL; Wan: UMT5-XXL; Z-Image: Qwen3; SD3.5: T5 and pooled CLIP-L/G; LTX-Video: "
                   "T5-XXL with its padding mask; LTX-2: Gemma 3 through its video and audio connectors). It is for "
                   "Overdrive's built-in test models, whose weights are random too. With real checkpoints use your "
                   "text encoder loader and CLIP Text Encode instead.")
    CATEGORY = "overdrive/testing"
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("positive", "negative")
    OUTPUT_TOOLTIPS = ("Conditioning drawn from the seed.", "Conditioning drawn from the seed + 1.")
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "family": (list(FAMILIES), {"tooltip": "The model family whose text-encoder output shape to produce."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1,
                             "tooltip": "Same seed, same conditioning; the negative uses seed + 1."}),
            "tokens": ("INT", {"default": 0, "min": 0, "max": 4096,
                               "tooltip": "Number of text tokens; 0 takes the family's usual length."}),
        }}

    def make(self, family, seed=0, tokens=0):
        if family not in FAMILIES:
            raise ValueError(f"Built-in Conditioning: unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")
        return conditioning(family, seed, tokens), conditioning(family, seed + 1, tokens)

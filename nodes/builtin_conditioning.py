"""Built-in Conditioning: prompt conditioning for Overdrive's built-in random-weight DiT models, so their workflows
run without downloading text encoders (ComfyUI builds those at full size only: T5-XXL alone is 9 GB)."""
from comfy_api.latest import io

from ..builtin_models import learned
from ..builtin_models.dit import FAMILIES, conditioning
from .schema import node_schema

SEED, TOKENS, PROMPT = 0, 0, ""  # tokens 0: the family's usual text length (a scene prompt's: 8)


class OverdriveBuiltinConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            "OverdriveBuiltinConditioning", "Built-in Conditioning (Overdrive)", category="overdrive/testing",
            description=("Fixed-seed random conditioning in the shape a family's text encoders produce (Flux: T5-XXL "
                         "tokens and a CLIP-L pooled vector; Flux.2: Mistral Small 3.1's stacked hidden layers; "
                         "Chroma: T5-XXL; Qwen-Image: Qwen2.5-VL; Wan: UMT5-XXL; Z-Image: Qwen3; SD3.5: T5 and pooled "
                         "CLIP-L/G; LTX-Video: T5-XXL with its padding mask; LTX-2: Gemma 3 through its video and "
                         "audio connectors). It is for Overdrive's built-in test models, whose weights are random "
                         "too. With a scene prompt it gives the reference models with learned weights "
                         "(overdrive-scenes-wan21-t2v, family wan22_14b; overdrive-scenes-sd35-mmdit, family sd35) "
                         "what they were trained on: a fixed vector per word (and their mean as the pooled vector), "
                         "the negative the empty prompt. With real checkpoints use your text encoder loader and CLIP "
                         "Text Encode instead."),
            inputs=[
                io.Combo.Input("family", options=list(FAMILIES),
                               tooltip="The model family whose text-encoder output shape to produce."),
                io.Int.Input("seed", default=SEED, min=0, max=2**31 - 1,
                             tooltip="Same seed, same conditioning; the negative uses seed + 1."),
                io.Int.Input("tokens", default=TOKENS, min=0, max=4096,
                             tooltip="Number of text tokens; 0 takes the family's usual length."),
                io.String.Input("prompt", default=PROMPT, optional=True,
                                tooltip="A scene for the reference models with learned weights, a word per "
                                        "attribute: size (small, large), colour (red, green, blue, yellow, purple, "
                                        "white), shape (circle, square, triangle, diamond), texture (plain, "
                                        "striped, dotted), position (top-left ... bottom-right, middle-centre), "
                                        "background (on-dark, on-light) and, for a clip, motion (still, "
                                        "moving-left/right/up/down). Empty: random conditioning from the seed."),
            ],
            outputs=[io.Conditioning.Output("positive", display_name="positive",
                                            tooltip="Conditioning drawn from the seed."),
                     io.Conditioning.Output("negative", display_name="negative",
                                            tooltip="Conditioning drawn from the seed + 1.")],
        )

    @classmethod
    def execute(cls, family, seed=SEED, tokens=TOKENS, prompt=PROMPT) -> io.NodeOutput:
        if family not in FAMILIES:
            raise ValueError(f"Built-in Conditioning: unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")
        if prompt and prompt.strip():  # the seed does not matter: a word's vector is fixed
            return io.NodeOutput(learned.conditioning(family, prompt, tokens), learned.conditioning(family, "", tokens))
        return io.NodeOutput(conditioning(family, seed, tokens), conditioning(family, seed + 1, tokens))

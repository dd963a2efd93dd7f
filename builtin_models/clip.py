"""Text encoders at the exact shapes of ComfyUI's fixed configs (comfy/sd1_clip_config.json,
comfy/clip_config_bigg.json): ComfyUI builds them from those files, not from the checkpoint, and any key
left out would stay uninitialised memory there. So "tiny" cannot shrink them."""
import math

from .tensors import Specs, TensorSpec, linear, norm, with_prefix

VOCAB, POSITIONS = 49408, 77
CLIP_L = dict(width=768, layers=12, mlp=3072)    # SD1.5's encoder and SDXL's first one
CLIP_BIGG = dict(width=1280, layers=32, mlp=5120)  # SDXL's second one (OpenCLIP ViT-bigG text tower)
LOGIT_SCALE = math.log(100.0)  # CLIP's trained value; ComfyUI loads it but does not use it for text


def clip_l_tensors(width: int, layers: int, mlp: int) -> Specs:
    """Hugging Face CLIPTextModel layout (`text_model.` ...), as in SD1.5 and SDXL checkpoints. Its
    text_projection and logit_scale are not stored: the original checkpoints lack them too, and ComfyUI
    sets them itself (identity, ln 100) — and its loader drops them from this prefix anyway."""
    out = [TensorSpec("text_model.embeddings.token_embedding.weight", (VOCAB, width)),
           TensorSpec("text_model.embeddings.position_embedding.weight", (POSITIONS, width))]
    for i in range(layers):
        layer = (norm("layer_norm1", width) + linear("self_attn.q_proj", width, width)
                 + linear("self_attn.k_proj", width, width) + linear("self_attn.v_proj", width, width)
                 + linear("self_attn.out_proj", width, width) + norm("layer_norm2", width)
                 + linear("mlp.fc1", mlp, width) + linear("mlp.fc2", width, mlp))
        out += with_prefix(f"text_model.encoder.layers.{i}.", layer)
    return out + norm("text_model.final_layer_norm", width)


def open_clip_tensors(width: int, layers: int, mlp: int) -> Specs:
    """OpenCLIP layout (fused attention in_proj, `resblocks`), as SDXL stores bigG; ComfyUI converts it
    (comfy.utils.clip_text_transformers_convert), transposing text_projection on the way."""
    out = [TensorSpec("token_embedding.weight", (VOCAB, width)), TensorSpec("positional_embedding", (POSITIONS, width))]
    for i in range(layers):
        layer = (norm("ln_1", width) + linear("attn.in_proj", 3 * width, width) + linear("attn.out_proj", width, width)
                 + norm("ln_2", width) + linear("mlp.c_fc", mlp, width) + linear("mlp.c_proj", width, mlp))
        out += with_prefix(f"transformer.resblocks.{i}.", layer)
    # OpenCLIP names the fused projection without the usual ".weight"/".bias" dot.
    out = [s._replace(key=s.key.replace("attn.in_proj.", "attn.in_proj_")) for s in out]
    return out + norm("ln_final", width) + [TensorSpec("text_projection", (width, width)),
                                           TensorSpec("logit_scale", (), LOGIT_SCALE)]

"""Tiny real diffusers models and pipelines with fixed-seed random weights (no model hub): for tests and the bench's
--tiny smoke mode."""
import json
import pathlib

import torch

TINY_UNET = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
                 norm_num_groups=8)
TINY_VAE = dict(in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, latent_channels=4,
                norm_num_groups=8, sample_size=16,
                down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"))
TOKENS = 16  # the tokenizer's and text encoder's sequence length


def seeded(cls, seed: int, **config):
    torch.manual_seed(seed)
    return cls(**config).eval().requires_grad_(False)


def tiny_unet(seed: int = 0, **overrides):
    from diffusers import UNet2DConditionModel
    return seeded(UNet2DConditionModel, seed, **{**TINY_UNET, **overrides})


def byte_characters() -> list:
    """The 256 characters a byte-level BPE (GPT-2's, CLIP's) spells bytes with: printable Latin-1 bytes stand for
    themselves, the others for code points from 256 up (transformers 5 no longer exports its copy)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]


def tiny_tokenizer(folder):
    """A byte-level CLIP tokenizer with no merges (every character is a token), written to `folder`."""
    from transformers import CLIPTokenizer
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = byte_characters()
    vocab = {token: i for i, token in enumerate(chars + [c + "</w>" for c in chars]
                                                  + ["<|startoftext|>", "<|endoftext|>"])}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=TOKENS)


def tiny_sd_pipeline(tokenizer_folder, unet_seed: int = 0, seed: int = 0):
    """A StableDiffusionPipeline of tiny components: UNet (unet_seed), VAE and CLIP text encoder (seed), DDIM."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel
    tokenizer = tiny_tokenizer(tokenizer_folder)
    text_config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=TOKENS,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(text_config).eval().requires_grad_(False)
    vae = seeded(AutoencoderKL, seed, **TINY_VAE)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=tiny_unet(unet_seed),
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe

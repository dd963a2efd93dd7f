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


def tiny_flux_pipeline(seed: int = 0):
    """A FluxPipeline of a tiny FluxTransformer2DModel (1 double block, 2 single blocks) and VAE, fixed-seed random,
    without text encoders: it is run with `flux_prompt()`'s embeddings, as a caller with cached embeddings does."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=None,
                        tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=transformer.eval())


def tiny_flux2_pipeline(seed: int = 0):
    """A Flux2Pipeline of a tiny Flux2Transformer2DModel (1 double block, 2 single blocks) and Flux.2 VAE (its latents
    patchified 2x2 and batch-normalised), fixed-seed random, without the text encoder: run with `dit_prompt()`'s
    embeddings (guidance-distilled, one call a step)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                          axes_dims_rope=(4, 4, 4, 4))
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8)
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=None,
                         tokenizer=None, transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_chroma_pipeline(seed: int = 0):
    """A ChromaPipeline of a tiny ChromaTransformer2DModel (1 double block, 2 single blocks, a one-layer approximator)
    and the tiny Flux VAE, fixed-seed random, without the text encoder: run with `dit_prompt()`'s embeddings and masks
    (true CFG: two calls a step)."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    torch.manual_seed(seed)
    transformer = ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           axes_dims_rope=(4, 6, 6), approximator_hidden_dim=32,
                                           approximator_layers=1)
    flux_vae = tiny_flux_pipeline(seed).vae
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=flux_vae, text_encoder=None,
                          tokenizer=None, transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_prompt() -> dict:
    """Fixed-seed T5 and CLIP embeddings of the tiny Flux pipeline's widths."""
    g = torch.Generator().manual_seed(0)
    return {"prompt_embeds": torch.randn(1, 8, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 16, generator=g)}


def tiny_wan_transformer(seed: int = 0):
    """A tiny WanTransformer3DModel (3 blocks), fixed-seed random."""
    from diffusers import WanTransformer3DModel
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3,
                                 rope_max_seq_len=64).eval()


def tiny_wan_pipeline(seed: int = 0, experts: bool = False):
    """A WanPipeline of a tiny Wan transformer and VAE, fixed-seed random, without a text encoder: it is run with
    `dit_prompt()`'s embeddings. experts: Wan 2.2 A14B's layout, a second transformer (seed + 100) for the low-noise
    half of the steps (boundary_ratio 0.5)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    transformer = tiny_wan_transformer(seed)  # the VAE's weights follow from the same stream
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=vae.eval(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                       transformer_2=tiny_wan_transformer(seed + 100) if experts else None,
                       boundary_ratio=0.5 if experts else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_qwen_image_pipeline(seed: int = 0):
    """A QwenImagePipeline of a tiny QwenImageTransformer2DModel (3 blocks) and Qwen-Image VAE, fixed-seed random,
    without a text encoder: it is run with `dit_prompt()`'s embeddings and their masks."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=None,
                             tokenizer=None, transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sd3_pipeline(seed: int = 0):
    """A StableDiffusion3Pipeline of a tiny SD3Transformer2DModel (3 joint blocks, the last "pre-only") and VAE,
    fixed-seed random, without its three text encoders: it is run with `dit_prompt()`'s embeddings."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=3,
                                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                        caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
                                        pos_embed_max_size=16)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(transformer=transformer.eval(), vae=vae.eval(),
                                    scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=None,
                                    tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None,
                                    tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_zimage_pipeline(seed: int = 0):
    """A ZImagePipeline of a tiny ZImageTransformer2DModel (one refiner block of each kind, 3 main layers) and VAE,
    fixed-seed random, without a text encoder: it is run with `dit_prompt()`'s embeddings."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=3, n_refiner_layers=1, n_heads=2,
                                           n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])
    # Gates small, as trained DiTs keep them (and the built-in fixtures draw them: builtin_models.dit.MODULATION): at
    # diffusers' default init they are tanh(O(1)), and a reused step measured 21-25 % from the full one, 0.1-0.6 % here.
    with torch.no_grad():
        for name, parameter in transformer.named_parameters():
            if "adaLN_modulation" in name or name.startswith("t_embedder"):
                parameter.mul_(0.1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5035)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae.eval(), text_encoder=None,
                          tokenizer=None, transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_ltx_pipeline(seed: int = 0):
    """An LTXPipeline of a tiny LTXVideoTransformer3DModel (3 blocks) and LTX video VAE (4x spatial and temporal
    compression), fixed-seed random, without a text encoder: it is run with `dit_prompt()`'s embeddings and masks."""
    from diffusers import (AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline,
                           LTXVideoTransformer3DModel)
    torch.manual_seed(seed)
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2,
                                             attention_head_dim=16, cross_attention_dim=32, num_layers=3,
                                             caption_channels=32)
    four = (1, 1, 1, 1)
    vae = AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
                                layers_per_block=four + (1,), decoder_layers_per_block=four + (1,),
                                spatio_temporal_scaling=(True, True, False, False),
                                decoder_spatio_temporal_scaling=(True, True, False, False),
                                decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4,
                                upsample_factor=four)
    pipe = LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae.eval(), text_encoder=None, tokenizer=None,
                       transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def dit_prompt(family: str) -> dict:
    """Fixed-seed prompt and negative-prompt embeddings (8 tokens of width 32) in the arguments each tiny pipeline
    takes, with classifier-free guidance on: every step calls the transformer twice, cond then uncond (SD3, Z-Image
    and LTX-Video: once, on both as a batch of 2; Flux.2: once, guidance-distilled)."""
    g = torch.Generator().manual_seed(0)
    positive, negative = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    if family == "zimage":  # one caption tensor per image, width 16
        return {"prompt_embeds": [positive[0, :, :16]], "negative_prompt_embeds": [negative[0, :, :16]],
                "guidance_scale": 3.0}
    if family == "sd3":
        pooled = torch.randn(2, 16, generator=g)
        return {"prompt_embeds": positive, "negative_prompt_embeds": negative, "pooled_prompt_embeds": pooled[:1],
                "negative_pooled_prompt_embeds": pooled[1:], "guidance_scale": 3.0}
    if family == "wan":
        return {"prompt_embeds": positive, "negative_prompt_embeds": negative, "guidance_scale": 3.0,
                "num_frames": 5}
    if family == "flux2":  # guidance-distilled: no negative prompt
        return {"prompt_embeds": positive, "guidance_scale": 4.0}
    mask = torch.ones(1, 8, dtype=torch.long)
    if family == "chroma":  # its pipeline passes the masks on to attention as they are: bool
        return {"prompt_embeds": positive, "prompt_attention_mask": mask.bool(), "negative_prompt_embeds": negative,
                "negative_prompt_attention_mask": mask.bool(), "guidance_scale": 3.0}
    if family == "ltxv":  # cond and uncond as one batch of 2
        return {"prompt_embeds": positive, "prompt_attention_mask": mask, "negative_prompt_embeds": negative,
                "negative_prompt_attention_mask": mask, "guidance_scale": 3.0, "num_frames": 9}
    return {"prompt_embeds": positive, "prompt_embeds_mask": mask, "negative_prompt_embeds": negative,
            "negative_prompt_embeds_mask": mask, "true_cfg_scale": 3.0}

"""VAEs that Compile VAE (and compile_ on a pipeline) leave uncompiled, and what they get instead.

Wan's causal video VAEs (ComfyUI's `WanVAE` of Wan 2.1 and 2.2, which Qwen-Image also uses; diffusers'
`AutoencoderKLWan` and `AutoencoderKLQwenImage`) decode one latent frame at a time in a Python loop, handing each
causal conv the last frames of the previous chunk through a list. Measured on an H200 under torch.inference_mode, as
ComfyUI runs its nodes (Wan 2.2, 832x480, 33 frames, torch 2.11; bench/results/2026-11-26_h200_wan22_vae_compile.json):
- eager 0.809 s a decode;
- `decode` compiled whole: its loop unrolled into 30 graphs whose CUDA graphs copy the caches in and out, 2.35 s;
- the decoder compiled per latent frame (no CUDA graphs): 0.731 s, but 17.8 % from eager; with its middle attention
  left eager 0.742 s and 0.3 %;
- eager with the 3-D convolutions' weights in channels_last_3d: **0.724 s (1.12x)**, 0.07 % from eager (cuDNN's
  other algorithms), peak memory 4.6 against 5.0 GiB, nothing to compile.
So these VAEs get the layout and no compile.
"""
EAGER_VAES = {
    "WanVAE": "Wan's causal video VAE decodes frame by frame in Python; compiled it was slower than eager (H200, Wan "
              "2.2 480p: 2.35 against 0.81 s), so it runs eager with channels_last_3d convolution weights (1.12x)",
}
EAGER_VAES["AutoencoderKLWan"] = EAGER_VAES["AutoencoderKLQwenImage"] = EAGER_VAES["WanVAE"]


def eager_reason(autoencoder) -> str | None:
    """Why this VAE is left uncompiled, or None when it compiles."""
    return EAGER_VAES.get(type(autoencoder).__name__)

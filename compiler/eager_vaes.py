"""VAEs that Compile VAE (and compile_ on a pipeline) leave uncompiled, and what they get instead.

Wan's causal video VAEs (ComfyUI's `WanVAE` of Wan 2.1 and 2.2, which Qwen-Image also uses; diffusers'
`AutoencoderKLWan` and `AutoencoderKLQwenImage`) decode one latent frame at a time in a Python loop, handing each
causal conv the last frames of the previous chunk through a list. Measured under torch.inference_mode, as ComfyUI
runs its nodes (bench/results/2026-11-26_h200_wan22_vae_compile.json):
- `decode` compiled whole: its loop unrolled into a graph per frame whose CUDA graphs copy the caches in and out,
  much slower than eager;
- the decoder compiled per latent frame (no CUDA graphs): faster, but far from eager's output unless its middle
  attention stays eager, and then barely faster;
- eager with the 3-D convolutions' weights in channels_last_3d: the fastest, within cuDNN's rounding of eager, with a
  lower peak memory and nothing to compile.
So these VAEs get the layout and no compile.
"""
EAGER_VAES = {
    "WanVAE": "Wan's causal video VAE decodes frame by frame in Python; compiled it decoded slower than eager, so it "
              "runs eager with channels_last_3d convolution weights (faster, nothing to compile)",
}
EAGER_VAES["AutoencoderKLWan"] = EAGER_VAES["AutoencoderKLQwenImage"] = EAGER_VAES["WanVAE"]


def eager_reason(autoencoder) -> str | None:
    """Why this VAE is left uncompiled, or None when it compiles."""
    return EAGER_VAES.get(type(autoencoder).__name__)

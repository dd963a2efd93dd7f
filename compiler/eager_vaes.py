"""Which VAEs Compile VAE (and compile_ on a pipeline) leave eager, and why.

Wan's causal video VAEs (ComfyUI's `WanVAE` of Wan 2.1 and 2.2, which Qwen-Image also uses; diffusers'
`AutoencoderKLWan` and `AutoencoderKLQwenImage`) decode one latent frame at a time in a Python loop, handing each
causal conv the last frames of the previous chunk through a list. Measured on an H200 (Wan 2.2, 832x480, 33 frames,
torch 2.11):
- compiled whole, `decode` unrolled that loop into 30 graphs whose CUDA graphs copied the caches in and out: 9.10 s
  a decode against eager's 1.63 s (bench/results/2026-11-26_h200_wan22_480p_stepcache_vae.json);
- the decoder compiled per chunk (no CUDA graphs) failed on the third chunk's graph (`cutlassF: no kernel found to
  launch` in the middle attention), and with that attention left eager it ran out of memory beside cuDNN's conv3d
  workspaces, which eager's decode already grows to 137 GiB (bench/results/logs/wan22_480p_vae_chunk_compile_*.log).
So they decode eager: 3-D convolutions are the work there, and Inductor calls cuDNN for them either way.
"""

EAGER_VAES = {
    "WanVAE": "Wan's causal video VAE decodes frame by frame through a Python cache list; compiled it ran 5.6x "
              "slower than eager (H200, Wan 2.2 480p), so it stays eager",
}
EAGER_VAES["AutoencoderKLWan"] = EAGER_VAES["AutoencoderKLQwenImage"] = EAGER_VAES["WanVAE"]


def eager_reason(autoencoder) -> str | None:
    """Why this VAE is left eager, or None when it compiles."""
    return EAGER_VAES.get(type(autoencoder).__name__)

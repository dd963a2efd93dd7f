"""The reference models with learned weights (trained by builtin_models/training.py on builtin_models/scenes.py's
scenes, shipped in builtin_models/learned/): their files as workflows name them, and the conditioning a scene prompt
gives them in place of a text encoder.

Each is a family's diffusion model at a small width with a VAE of the family's layout, loaded by ComfyUI's Load
Diffusion Model and Load VAE like any file, and each draws the colour, size, position and background a prompt names
("large red circle striped top-left on-dark"), shapes rounded and textures left out (README, reference models):
images whose likeness to eager's image tells what an accelerator changes.
- wan22_14b: WAN21_T2V (a video DiT: Wan 2.1 and Wan 2.2 A14B's layout) with a Wan 2.1 VAE at its smallest width;
  images and short clips.
- sd35: SD3's MMDiT (joint text and image blocks, the layout of SD3.5 and close to Flux's double blocks) with SD3's
  tiny autoencoder (TAESD3, in one file as ComfyUI's Load VAE reads it); images."""
import pathlib
from typing import NamedTuple

import torch

from . import scenes
from .dit import FAMILIES

FOLDER = pathlib.Path(__file__).with_name("learned")  # where the trained files ship
SIDE = 128  # the side the models were trained at; other multiples of 16 work, less well


class LearnedModel(NamedTuple):
    family: str       # the builtin_models.dit family whose layout the files have
    vae: str          # "wan21": ComfyUI's Wan 2.1 VAE; "taesd3": SD3's tiny autoencoder
    config: dict      # what the diffusion model's unet_config changes from the family's full one (width, depth)
    model_name: str   # the file names workflows use (models/diffusion_models, models/vae)
    vae_name: str
    dit_file: str     # the files in FOLDER
    vae_file: str

    @property
    def video(self) -> bool:
        """Whether it also learned clips: its family's latents are a video's."""
        return FAMILIES[self.family].latent.get("video", False)


def _sd3_width(depth: int) -> dict:
    """SD3's MMDiT is 64 channels per head and a head per block: its text projection follows the depth."""
    return dict(depth=depth, context_embedder_config={"target": "torch.nn.Linear",
                                                      "params": {"in_features": 4096, "out_features": 64 * depth}})


MODELS = {
    "wan22_14b": LearnedModel("wan22_14b", "wan21", dict(dim=256, num_heads=2, ffn_dim=1024, num_layers=4),
                              "overdrive-scenes-wan21-t2v.safetensors", "overdrive-scenes-wan21-vae.safetensors",
                              "scenes_wan21_t2v.safetensors", "scenes_vae_wan21.safetensors"),
    "sd35": LearnedModel("sd35", "taesd3", {**_sd3_width(3), "num_patches": 1024, "pos_embed_max_size": 32},
                         "overdrive-scenes-sd35-mmdit.safetensors", "overdrive-scenes-sd35-taesd3.safetensors",
                         "scenes_sd35_mmdit.safetensors", "scenes_taesd3.safetensors"),
}


def files(names=None) -> dict:
    """{folder: {workflow file name: path}} as harness.workflows.model_paths_config takes them, for the models
    `names` (every one by default) whose files are here."""
    out = {"diffusion_models": {}, "vae": {}}
    for name in names or MODELS:
        m = MODELS[name]
        if available(name):
            out["diffusion_models"][m.model_name] = FOLDER / m.dit_file
            out["vae"][m.vae_name] = FOLDER / m.vae_file
    return out


def available(name: str) -> bool:
    m = MODELS[name]
    return all((FOLDER / f).is_file() for f in (m.dit_file, m.vae_file))


def conditioning(family: str, prompt: str, tokens: int = 0) -> list:
    """ComfyUI CONDITIONING for a scene prompt at the family's text width: a fixed vector per word (scenes.embed), and
    their mean where the family's encoders also give a pooled vector; a prompt with a motion word is a clip's (the
    video model learned clips with it, images without). The empty prompt is all zeros, as the models learned it."""
    cond = FAMILIES[family].cond
    extra = sorted(set(cond) - {"tokens", "width", "pooled"})
    if extra or family not in MODELS:
        why = f"its encoders also give {', '.join(extra)}" if extra else "no reference model has its layout"
        raise ValueError(f"Built-in Conditioning: a scene prompt is for the reference models with learned weights "
                         f"(families {', '.join(MODELS)}: {', '.join(m.model_name for m in MODELS.values())}), not "
                         f"{family} ({why}). Clear the prompt for random conditioning.")
    video = any(scenes.WORDS.get(word) == "motion" for word in prompt.lower().split())
    extras = {}
    if "pooled" in cond:
        extras["pooled_output"] = (scenes.pooled(prompt, cond["pooled"], video) if prompt.strip()
                                   else torch.zeros(1, cond["pooled"]))
    return [[scenes.embed(prompt, cond["width"], tokens or scenes.TOKENS, video), extras]]

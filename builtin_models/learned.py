"""The reference models with learned weights (trained by builtin_models/training.py on builtin_models/scenes.py's
scenes, shipped in builtin_models/learned/): their files as workflows name them, and the conditioning a scene prompt
gives them in place of a text encoder.

They are a WAN21_T2V diffusion model at the tiny width and a Wan 2.1 VAE at its smallest, loaded by ComfyUI's Load
Diffusion Model and Load VAE like any file, and they draw the scene a prompt names ("large red circle striped
top-left on-dark"): images whose likeness to eager's image tells what an accelerator changes."""
from . import scenes
from .dit import FAMILIES
from .training import DIT_FILE, FAMILY, FOLDER, VAE_FILE

# The file names the scenes workflow uses (models/diffusion_models, models/vae).
MODEL_NAME, VAE_NAME = "overdrive-scenes-wan21-t2v.safetensors", "overdrive-scenes-wan21-vae.safetensors"
SIDE = 128  # the side the models were trained at; other multiples of 16 work, less well


def files() -> dict:
    """{folder: {workflow file name: path}} as harness.workflows.model_paths_config takes them."""
    return {"diffusion_models": {MODEL_NAME: FOLDER / DIT_FILE}, "vae": {VAE_NAME: FOLDER / VAE_FILE}}


def available() -> bool:
    return all((FOLDER / name).is_file() for name in (DIT_FILE, VAE_FILE))


def conditioning(family: str, prompt: str, tokens: int = 0) -> list:
    """ComfyUI CONDITIONING for a scene prompt at the family's text width: a fixed vector per word (scenes.embed); a
    prompt with a motion word is a clip's (the models learned clips with it, images without). Only where the family's
    text encoder gives tokens alone; the reference models are of FAMILY's layout."""
    cond = FAMILIES[family].cond
    extra = sorted(set(cond) - {"tokens", "width"})
    if extra:
        raise ValueError(f"Built-in Conditioning: a scene prompt gives text tokens only, and {family} also takes "
                         f"{', '.join(extra)}; scene prompts are for the reference models with learned weights "
                         f"(family {FAMILY}, files {MODEL_NAME} and {VAE_NAME}). Clear the prompt for random "
                         "conditioning.")
    video = any(scenes.WORDS.get(word) == "motion" for word in prompt.lower().split())
    return [[scenes.embed(prompt, cond["width"], tokens or scenes.TOKENS, video), {}]]

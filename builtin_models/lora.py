"""Fixed-seed LoRA files for a built-in diffusion model (or any diffusion-model file): a low-rank term on every linear
layer of its blocks, in the key format ComfyUI reads without conversion ("diffusion_model.<layer>.lora_up.weight",
".lora_down.weight", ".alpha"), as LoraLoaderModelOnly loads a user's.

Each term changes its layer's weight by about `scale` of the weight's own size (the built-in models' weights are
N(0, 1/fan_in)): enough to move an image, not enough to wreck it."""
import hashlib
import json
import pathlib

import torch
from safetensors import safe_open

from .checkpoint import GENERATOR_VERSION
from .writer import write_safetensors

BLOCK_WORDS = ("blocks.",)  # the layers a LoRA of a DiT usually trains: its blocks' linear layers


def block_linears(model_path) -> list:
    """(layer name, out features, in features) of the 2-D weights under the model's blocks, in file order."""
    with safe_open(str(model_path), framework="pt", device="cpu") as opened:
        layers = []
        for key in opened.keys():
            shape = opened.get_slice(key).get_shape()
            if key.endswith(".weight") and len(shape) == 2 and any(word in key for word in BLOCK_WORDS):
                layers.append((key[:-len(".weight")], shape[0], shape[1]))
    return layers


def lora_name(model_path, rank: int, seed: int, scale: float) -> str:
    spec = [GENERATOR_VERSION, pathlib.Path(model_path).name, rank, seed, scale]
    digest = hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:8]
    return f"overdrive-lora-r{rank}-s{seed}-{digest}.safetensors"


def ensure_lora(model_path, directory, rank: int = 16, seed: int = 0, scale: float = 0.1,
                dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """A LoRA file for the diffusion model at `model_path` (in `directory`), generated once; same arguments, same
    bytes."""
    path = pathlib.Path(directory) / lora_name(model_path, rank, seed, scale)
    if path.is_file():
        return path
    layers = block_linears(model_path)
    shapes, factors = [], {}
    for index, (layer, out_features, in_features) in enumerate(layers):
        key = f"diffusion_model.{layer}"
        shapes += [(f"{key}.lora_up.weight", (out_features, rank)), (f"{key}.lora_down.weight", (rank, in_features))]
        factors[f"{key}.lora_up.weight"] = (index, scale / rank ** 0.5)
        factors[f"{key}.lora_down.weight"] = (index, 1 / in_features ** 0.5)

    by_key = dict(shapes)

    def make(key):
        index, std = factors[key]
        generator = torch.Generator().manual_seed(seed * 100003 + 2 * index + key.endswith("down.weight"))
        return (torch.randn(by_key[key], generator=generator) * std).to(dtype)

    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(path, shapes, dtype, make, {"overdrive_generated": f"lora/r{rank}/s{seed}",
                                                  "overdrive_generator_version": str(GENERATOR_VERSION)})
    return path

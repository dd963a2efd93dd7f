"""How to compile Wan 2.2's video VAE? Not: eager with channels-last 3-D convs, 1.12x (2026-11-26_h200_wan22_vae_compile.json).

In one process under inference mode: eager, `decode` compiled whole, the decoder compiled per latent frame (its
middle attention compiled or eager), eager with channels_last_3d weights; ComfyUI's VAE, bf16, 832x480, 33 frames.
Analysis: bench/experiments/step-cache-vaes-diffusers-flux.md.

    PYTHONPATH=<folder holding overdrive> python bench/probes/wan_vae_compile.py \
        --out bench/results/DATE_GPU_wan22_vae_compile.json
"""
import argparse
import copy
import json
import logging
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/, beside probes/
from bench_compile import time_decodes  # noqa: E402
from report import environment  # noqa: E402


def patched(vae, patches: dict):
    """A copy of ComfyUI's VAE whose model gets `patches` (attribute path -> object) while it is loaded."""
    out = copy.copy(vae)
    out.patcher = vae.patcher.clone()
    for path, value in patches.items():
        out.patcher.add_object_patch(path, value)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--variants", default="eager,whole,per_chunk,per_chunk_attention_eager,channels_last_3d")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("overdrive").setLevel(logging.INFO)
    from overdrive.builtin_models import dit
    from overdrive.compiler import CompiledMethod, CompileOptions
    from overdrive.compiler.layouts import conv_weights_channels_last_
    from overdrive.harness.inprocess import build_family_vae, import_comfy
    comfy = import_comfy(cpu=not torch.cuda.is_available())
    vae = build_family_vae(comfy, "wan22")
    model = vae.first_stage_model
    latent = torch.randn(dit.empty_latent("wan22", 832, 480, args.frames).shape,
                         generator=torch.Generator().manual_seed(0))
    per_chunk = CompileOptions(cuda_graphs=False, precompile=False, dynamic="static")
    attention = {f"decoder.{name}.forward": torch.compiler.disable(block.forward)
                 for name, block in model.decoder.named_modules() if type(block).__name__ == "AttentionBlock"}
    rows, reference = [], None
    for variant in args.variants.split(","):
        if variant == "eager":
            target = vae
        elif variant == "whole":
            target = patched(vae, {"decode": CompiledMethod(model, "decode", CompileOptions())})
        elif variant == "per_chunk":
            target = patched(vae, {"decoder.forward": CompiledMethod(model.decoder, "forward", per_chunk)})
        elif variant == "per_chunk_attention_eager":
            target = patched(vae, {"decoder.forward": CompiledMethod(model.decoder, "forward", per_chunk),
                                   **attention})
        elif variant == "channels_last_3d":
            conv_weights_channels_last_(model, torch.nn.Conv3d)
            target = vae
        else:
            raise ValueError(f"unknown variant {variant}")
        try:
            row = time_decodes(variant, target, latent, args.repeats)
        except Exception as error:  # noqa: BLE001 - a variant that fails is a result too
            row = {"variant": variant, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        if "image" in row:
            image = row.pop("image")
            reference = image if reference is None else reference
            row["rel_err_vs_eager"] = float((image.float() - reference.float()).norm() / reference.float().norm())
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump({"benchmark": "wan22_vae_compile", "settings": vars(args), "environment": environment(),
                   "vae_dtype": str(vae.vae_dtype), "latent_shape": list(latent.shape), "results": rows},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

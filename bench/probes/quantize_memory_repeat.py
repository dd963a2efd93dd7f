"""Does a dropped Quantize Model free its layers? Not while a hook held them (2026-11-25_h200_quantize_memory_repeat_wan22_compile.json).

A DiT quantized several times (the node's cache answering after the first), optionally compiled, sampled, dropped as
a workflow change drops it: the bytes still allocated, whether its 8-bit layers live on, what holds them. With the
hook holding them weakly none does (`..._weak_hook.json`). Analysis: bench/experiments/dit-families-comfyui-07.md.

    python bench/probes/quantize_memory_repeat.py --arch wan22 --res 480 --width 832 --frames 33 --rounds 4 [--compile]
"""
import argparse
import gc
import json
import weakref

import torch

from overdrive.builtin_models import dit
from overdrive.harness.inprocess import build_dit_model, import_comfy


def holders(obj, depth=3) -> list:
    """Types along one referrer chain of `obj` (skipping frames and this script's own containers)."""
    chain, current = [], obj
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(current) if not isinstance(r, (type(gc), list)) and
                     type(r).__name__ not in ("frame", "function")]
        if not referrers:
            break
        current = referrers[0]
        name = type(current).__name__
        if isinstance(current, dict):
            name += f"(keys like {list(current)[:3]})"
        chain.append(name)
    return chain


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="wan22", choices=list(dit.FAMILIES))
    parser.add_argument("--res", type=int, default=480)
    parser.add_argument("--width", type=int)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    comfy = import_comfy(cpu=not torch.cuda.is_available())
    import comfy.model_management
    import comfy.sample
    from overdrive.nodes import NODES as nodes
    from overdrive.comfy_host.quantize_patches import PREFIX

    base = build_dit_model(comfy, args.arch, "full", torch.bfloat16)
    positive, negative = dit.conditioning(args.arch, 1), dit.conditioning(args.arch, 2)
    latent = dit.empty_latent(args.arch, args.width or args.res, args.res, args.frames)
    noise = comfy.sample.prepare_noise(latent, 42)
    gib = 2 ** 30
    rows, alive = [], []
    for round_ in range(args.rounds):
        model = nodes["OverdriveQuantizeModel"].execute(base, format="fp8_e4m3", positive=positive,
                                                           negative=negative, latent={"samples": latent})[0]
        if args.compile:
            model = nodes["OverdriveCompileModel"].execute(model)[0]
        layer = next(v for k, v in model.object_patches.items() if k.startswith(PREFIX) and
                     isinstance(v, torch.nn.Module))
        alive.append(weakref.ref(layer))
        torch.cuda.reset_peak_memory_stats()
        comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", positive, negative, latent, seed=42,
                            disable_pbar=True)
        peak = torch.cuda.max_memory_allocated() / gib
        del model, layer
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
        gc.collect()
        row = {"round": round_, "peak_gib": round(peak, 2),
               "allocated_after_drop_gib": round(torch.cuda.memory_allocated() / gib, 2),
               "dropped_8bit_layers_alive": [ref() is not None for ref in alive]}
        still = next((ref() for ref in alive if ref() is not None), None)
        if still is not None:
            row["held_by"] = holders(still)
        del still
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

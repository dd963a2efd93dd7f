"""Where is a DiT's fp8 call error made? Chroma's approximator, LTX's caption path (2026-11-27_h100_chroma_fp8_layer_groups.json).

The model quantized as Quantize Model does (`--all-layers`: the family's float layers too), then each group of
quantized layers swapped alone into the float model, its first model call compared with the float model's.
Analysis: bench/experiments/flux2-chroma-fp8-error.md, bench/experiments/ltx2.md.

    source bench/device_env.sh
    python3 bench/probes/fp8_layer_groups.py --arch chroma --res 1024 --out bench/results/DATE_GPU_chroma_fp8_layer_groups.json
"""
import argparse
import collections
import json
import re
import time

import torch

from overdrive.builtin_models import dit
from overdrive.step_cache.runner import relative_error
from overdrive.families import family_of
from overdrive.quantization import QuantConfig, apply_modules, plan_quantization, restore_modules
from overdrive.quantization.candidates import keeping_float
from overdrive.harness.inprocess import build_dit_model, import_comfy


def capture_calls(comfy, patcher, arch, res, frames, steps):
    """(args, kwargs) of the diffusion model's calls while ComfyUI samples `steps` steps, tensors copied."""
    import comfy.sample

    calls = []

    def hook(module, args, kwargs):
        keep = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
        calls.append((tuple(keep(a) for a in args), {k: keep(v) for k, v in kwargs.items()}))
    handle = patcher.model.diffusion_model.register_forward_pre_hook(hook, with_kwargs=True)
    latent = dit.empty_latent(arch, res, res, frames)
    cfg = dit.FAMILIES[arch].sampling["cfg"]
    try:
        comfy.sample.sample(patcher, comfy.sample.prepare_noise(latent, 7), steps, cfg, "euler", "simple",
                            dit.conditioning(arch, 1), dit.conditioning(arch, 2), latent, seed=7, disable_pbar=True)
    finally:
        handle.remove()
    return calls


def group_of(name: str) -> tuple:
    """(top-level module, the layer's name with block indices dropped)."""
    return name.split(".")[0], re.sub(r"\.\d+(?=\.|$)", "", name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="chroma", choices=list(dit.FAMILIES))
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--format", default="fp8_e4m3")
    parser.add_argument("--all-layers", action="store_true", help="quantize the family's float layers too")
    parser.add_argument("--out")
    args = parser.parse_args()

    comfy = import_comfy(cpu=not torch.cuda.is_available())
    patcher = build_dit_model(comfy, args.arch, args.size, torch.bfloat16)
    model = patcher.model.diffusion_model
    calls = capture_calls(comfy, patcher, args.arch, args.res, args.frames, steps=3)
    started = time.perf_counter()
    float_layers = {} if args.all_layers else dict(family_of(model).float_layers)  # as QuantizeModel leaves them
    with torch.no_grad():
        plan = plan_quantization(model, QuantConfig(format=args.format), filter_fn=keeping_float(float_layers),
                                 calibration=lambda: [model(*a, **k) for a, k in calls])
    quantize_s = time.perf_counter() - started
    kinds = {layer.name: "weight-only" if layer.weight_only else "8-bit GEMM"
             for layer in plan.report.layers if layer.name in plan.modules}

    rows = []
    with torch.no_grad():
        for index in (0, len(calls) - 1):  # the first call and the last one captured
            a, k = calls[index]
            reference = model(*a, **k)

            def error(names):
                originals = apply_modules(model, {n: plan.modules[n] for n in names})
                try:
                    # LTX-2's output is the list (video, audio)
                    return relative_error(dit.flat_latent(model(*a, **k)), dit.flat_latent(reference))
                finally:
                    restore_modules(model, originals)
            groups = collections.defaultdict(list)
            for name in plan.modules:
                top, layer = group_of(name)
                groups[("top", top)].append(name)
                groups[("layer", layer)].append(name)
            rows.append({"call": index, "group": "all", "layers": len(plan.modules), "error": error(plan.modules)})
            for (kind, group), names in sorted(groups.items()):
                rows.append({"call": index, "group": f"{kind}: {group}", "layers": len(names),
                             "kinds": dict(collections.Counter(kinds[n] for n in names)), "error": error(names)})
                print(json.dumps(rows[-1]), flush=True)
    report = {"arch": args.arch, "size": args.size, "res": args.res, "format": args.format,
              "float_layers": float_layers,
              "quantize_s": round(quantize_s, 1), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "torch": torch.__version__, "rows": rows}
    print("| call | group | layers | error |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['call']} | {row['group']} | {row['layers']} | {row['error']:.2e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

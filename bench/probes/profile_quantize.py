"""Where did Quantize Model's 66.5 s go? Hashing and caching weights: now 6.0 s (2026-11-25_h200_flux_1024_quantize_profile.json).

The node on a fresh cache under cProfile (phase seconds, top functions), then on the cache it filled (a hit).
Analysis: bench/experiments/quantize-model-time.md.

  python bench/probes/profile_quantize.py --arch flux --res 1024 [--top 30] [--out bench/results/x.json]
"""
import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import sys
import tempfile
import time

import torch

from overdrive.builtin_models import dit
from overdrive.harness.inprocess import build_dit_model, import_comfy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, beside probes/
from report import environment  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="flux", choices=list(dit.FAMILIES))
    parser.add_argument("--res", type=int, default=1024)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("overdrive").setLevel(logging.INFO)
    os.environ["OVERDRIVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="overdrive-quantize-")  # a cache miss: calibrate
    comfy = import_comfy(cpu=not torch.cuda.is_available())
    from overdrive.comfy_host.quantized_model import quantization_report
    from overdrive.nodes.quantize_node import OverdriveQuantizeModel

    base = build_dit_model(comfy, args.arch, args.size, torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    latent = {"samples": dit.empty_latent(args.arch, args.res, args.res, args.frames)}
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    quantized = OverdriveQuantizeModel.execute(base, positive=dit.conditioning(args.arch, 1),
                                               negative=dit.conditioning(args.arch, 2), latent=latent,
                                               attention="sdpa")[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profile.disable()
    seconds = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    report = quantization_report(quantized)
    start = time.perf_counter()
    again = quantization_report(OverdriveQuantizeModel.execute(base, positive=dit.conditioning(args.arch, 1),
                                                               negative=dit.conditioning(args.arch, 2),
                                                               latent=latent, attention="sdpa")[0])
    hit_seconds = time.perf_counter() - start
    result = {"benchmark": "quantize_profile", "settings": vars(args), "environment": environment(),
              "node_seconds": round(seconds, 2), "report_seconds": report.seconds if report else None,
              "quantized": len(report.quantized) if report else None,
              "cache_hit_node_seconds": round(hit_seconds, 2),
              "cache_hit": bool(again and again.cache_hit), "profile": text.getvalue()}
    print(json.dumps({k: v for k, v in result.items() if k != "profile"}, indent=1))
    print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

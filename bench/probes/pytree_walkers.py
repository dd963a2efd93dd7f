"""Could torch's pytree replace the per-call argument walkers? No: 1.6-2.9x the host time (2026-12-01_cpu_pytree_walkers.json).

The walkers of compiler/block_graphs.py and compiler/compiled_method.py against torch.utils._pytree, on a Flux
double block's and an LTX-2 block's arguments. CPU only (host time).
Analysis: bench/experiments/pytree-argument-walkers.md.

    python bench/probes/pytree_walkers.py [--out bench/results/FILE.json]
"""
import argparse
import json
import platform
import timeit

import torch
import torch.utils._pytree as pytree

from overdrive.compiler.block_graphs import _flatten, _rebuilt
from overdrive.compiler.compiled_method import shape_signature


def flux_double_block_call():
    img, txt, vec = torch.zeros(1, 4096, 8), torch.zeros(1, 512, 8), torch.zeros(1, 8)
    pe = torch.zeros(1, 1, 4608, 64, 2, 2)
    options = {"block_index": 3, "block_type": "double", "patches": {}, "patches_replace": {}, "cond_or_uncond": [0],
               "sigmas": torch.zeros(1), "transformer_index": 0, "wrappers": {}, "callbacks": {}}
    return (), {"img": img, "txt": txt, "vec": vec, "pe": pe, "attn_mask": None, "transformer_options": options}


def ltx2_block_call():
    video, audio = torch.zeros(1, 4096, 8), torch.zeros(1, 256, 8)
    return ([video, audio],), {"v_context": torch.zeros(1, 128, 8), "a_context": torch.zeros(1, 128, 8),
                               "timestep": (torch.zeros(1, 6), torch.zeros(1, 6)), "transformer_options": {}}


def walkers(args, kwargs):
    def hand_written():
        tensors, objects = [], []
        key = _flatten((args, kwargs), tensors, objects)
        _rebuilt((args, kwargs), iter(tensors))
        return key

    def with_pytree():
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = (spec, tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else
                           (type(x), x if x is None or isinstance(x, (bool, int, float, str)) else id(x))
                           for x in leaves))
        pytree.tree_unflatten(leaves, spec)
        return key

    def signature_hand_written():
        return shape_signature(args, kwargs)

    def signature_with_pytree():
        return tuple((tuple(x.shape), str(x.dtype), str(x.device)) for x in pytree.tree_leaves((args, kwargs))
                     if isinstance(x, torch.Tensor))

    return {"describe+rebuild (block_graphs)": (hand_written, with_pytree),
            "shape signature (compiled_method)": (signature_hand_written, signature_with_pytree)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--number", type=int, default=20000)
    cli = parser.parse_args()
    rows = []
    for name, (args, kwargs) in {"flux double block": flux_double_block_call(), "ltx2 block": ltx2_block_call()}.items():
        for walk, (own, tree) in walkers(args, kwargs).items():
            us = [min(timeit.repeat(f, number=cli.number, repeat=5)) / cli.number * 1e6 for f in (own, tree)]
            rows.append({"call": name, "walk": walk, "hand_written_us": round(us[0], 2), "pytree_us": round(us[1], 2)})
            print(f"{name:18s} {walk:36s} hand-written {us[0]:6.2f} us   pytree {us[1]:6.2f} us")
    if cli.out:
        with open(cli.out, "w") as f:
            json.dump({"benchmark": "pytree_walkers", "torch": torch.__version__, "python": platform.python_version(),
                       "cpu": platform.processor() or platform.machine(), "timing": f"min of 5 x {cli.number} calls",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

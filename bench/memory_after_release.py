"""What GPU memory stays allocated after a compiled model is dropped (GPU; CUDA graphs only exist there).

Tenth session: in bench_diffusers, the rows after `overdrive-precompile` had ~2.5 GiB more peak VRAM than the same
rows before it. This builds a diffusers UNet (SDXL's block layout, narrower), compiles it with Overdrive (precompile, then
plain), runs it, drops it, and reports the bytes still allocated, then after forgetting Overdrive's in-memory
graphs, then after torch._dynamo.reset(); the `tmp` names torch leaked into Dynamo's guard closure
variables (fixed in compiler/precompiled.py, eleventh session); plus the largest live CUDA tensors and who holds them.

  python bench/memory_after_release.py --out bench/results/DATE_h100_memory_after_release.json
"""
import argparse
import gc
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_diffusers import SDXL_UNET  # noqa: E402
from report import environment, write_report  # noqa: E402

UNET = dict(SDXL_UNET, block_out_channels=(160, 320, 640), transformer_layers_per_block=(1, 1, 2),
            attention_head_dim=(5, 10, 10))


def guard_temporaries() -> list:
    """The `tmp` names in Dynamo's shared guard closure variables (torch leaks them; compiler/precompiled.py)."""
    from overdrive.compiler.precompiled import _TEMPORARY, _guard_closure_vars
    return [name for name in _guard_closure_vars() if _TEMPORARY.fullmatch(name)]


def allocated_mib() -> float:
    gc.collect()
    torch.cuda.synchronize()
    return round(torch.cuda.memory_allocated() / 2**20, 1)


def _describe(obj) -> str:
    kind = type(obj)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(obj, dict):
        return f"{name}(keys {[str(k)[:40] for k in list(obj)[:5]]})"
    if isinstance(obj, (tuple, list)):
        return f"{name}(len {len(obj)})"
    return name


def holders(tensor, ignore: set, depth=14) -> list:
    """The shortest referrer path from `tensor` up to a module's globals, a class or a root object (breadth first;
    frames and this script's own containers skipped)."""
    import types
    module_dicts = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    queue, parents = [tensor], {id(tensor): None}
    for _ in range(depth):
        nxt = []
        for obj in queue:
            for ref in gc.get_referrers(obj):
                if id(ref) in parents or id(ref) in ignore or isinstance(ref, types.FrameType) or ref is queue:
                    continue
                parents[id(ref)] = (obj, ref)
                if id(ref) in module_dicts or isinstance(ref, type) or not gc.get_referrers(ref):
                    path, item = [], ref
                    while parents.get(id(item)) is not None:
                        child, holder = parents[id(item)]
                        key = ""
                        if isinstance(holder, dict):
                            key = next((f"[{str(k)[:50]}]" for k, v in holder.items() if v is child), "[key]")
                        path.append(_describe(holder) + key + (f" = module {module_dicts[id(holder)]}"
                                                                if id(holder) in module_dicts else ""))
                        item = child
                    return path[::-1]
                nxt.append(ref)
        queue = nxt
    return ["(no root found within depth)"]


def live_cuda_tensors(limit=3) -> list:
    """The largest live, real (not fake) CUDA tensors, and what holds them."""
    from torch._subclasses.fake_tensor import is_fake
    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not is_fake(o) and o.is_cuda]
    found.sort(key=lambda t: -t.untyped_storage().nbytes())
    top = found[:limit]
    del found
    gc.collect()
    ignore = {id(top)}
    return [{"shape": list(t.shape), "dtype": str(t.dtype), "type": type(t).__name__,
             "mib": round(t.untyped_storage().nbytes() / 2**20, 1), "held_by": holders(t, ignore)} for t in top]


def run(precompile: bool, side: int) -> dict:
    from diffusers import UNet2DConditionModel
    from overdrive.api import CompileOptions, compile_
    from overdrive.compiler import clear_shared_graphs
    before = allocated_mib()
    torch.manual_seed(0)
    with torch.device("cuda"):
        unet = UNet2DConditionModel(sample_size=side, **{k: v for k, v in UNET.items() if k != "sample_size"})
    unet = unet.half().eval().requires_grad_(False)
    weights = allocated_mib() - before
    compile_(unet, CompileOptions(precompile=precompile))
    x = torch.randn(2, 4, side, side, device="cuda", dtype=torch.half)
    cond = {"encoder_hidden_states": torch.randn(2, 77, 2048, device="cuda", dtype=torch.half),
            "added_cond_kwargs": {"text_embeds": torch.randn(2, 1280, device="cuda", dtype=torch.half),
                                  "time_ids": torch.full((2, 6), float(side * 8), device="cuda", dtype=torch.half)}}
    with torch.inference_mode():
        for _ in range(3):
            unet(x, torch.tensor([500.0, 500.0], device="cuda"), **cond, return_dict=False)
    running = allocated_mib() - before
    del unet, x, cond
    row = {"precompile": precompile, "weights_mib": weights, "after_3_calls_mib": running,
           "held_after_drop_mib": allocated_mib() - before, "guard_temporaries_left": guard_temporaries()}
    clear_shared_graphs()
    row["held_after_clear_shared_graphs_mib"] = allocated_mib() - before
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    row["held_after_reset_cudagraph_trees_mib"] = allocated_mib() - before
    torch._dynamo.reset()
    row["held_after_dynamo_reset_mib"] = allocated_mib() - before
    row["largest_live_after_reset"] = live_cuda_tensors()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=128, help="latent side (128: 1024² images)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = {"benchmark": "memory_after_release", "environment": environment(), "unet": UNET, "side": args.side,
              "results": []}
    for precompile in (True, False):
        row = run(precompile, args.side)
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        write_report(report, args.out)


if __name__ == "__main__":
    main()

"""What outlives a dropped compiled UNet? Its CUDA graph's last inputs, bounded (2026-11-24_h100_memory_after_release_fixed.json).

A narrow diffusers SDXL UNet compiled (precompile, then plain), run, dropped: the bytes still allocated, after
Overdrive's in-memory graphs are forgotten, after torch._dynamo.reset(), and who holds the largest tensors. Before
the fix 248 MiB more stayed, held through the `tmp` names torch leaks into Dynamo's guard closure variables
(compiler/precompiled.py removes them). Analysis: bench/results/archive_2026-11-23_h100.md, "The precompile leak".

  python bench/probes/memory_after_release.py --out bench/results/DATE_h100_memory_after_release.json
"""
import argparse
import gc
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/, beside probes/
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


def _key_of(holder: dict, value) -> str:  # no generator: one would close over `value` and refer to it too
    for key, item in holder.items():
        if item is value:
            return f"[{str(key)[:50]}]"
    return "[key]"


def holders(tensor, ignore: set, depth=16) -> list:
    """Who holds `tensor`: at each level every referrer's type (frames and this search's own lists skipped), then up
    through the first one not seen before. One gc.get_referrers per level: a breadth-first search over a heap full of
    compiled graphs took more than 4 minutes on the GPU machine."""
    import types
    module_dicts = {id(vars(m)): name for name, m in list(sys.modules.items()) if m is not None}
    seen, levels, obj = {id(tensor)}, [], tensor
    for _ in range(depth):
        refs = [r for r in gc.get_referrers(obj) if id(r) not in ignore and not isinstance(r, types.FrameType)]
        if not refs:
            levels.append("(no tracked referrer: held from C/C++ or a cycle's end)")
            break
        level = []
        for ref in refs[:6]:
            key = ""
            if isinstance(ref, dict):
                key = _key_of(ref, obj)
            level.append(_describe(ref) + key + (f" = module {module_dicts[id(ref)]}" if id(ref) in module_dicts else ""))
        levels.append(" | ".join(level) + (f" (+{len(refs) - 6})" if len(refs) > 6 else ""))
        nxt = next((r for r in refs if id(r) not in seen), None)
        if nxt is None or id(nxt) in module_dicts or isinstance(nxt, type):
            break
        seen.add(id(nxt))
        ignore.add(id(refs))
        obj = nxt
    return levels


def suspects() -> dict:
    """Caches in torch that outlive torch._dynamo.reset() and could hold a model's CUDA tensors."""
    found = {}
    try:
        from torch._inductor.codecache import PyCodeCache
        modules = list(getattr(PyCodeCache, "modules", [])) + list(getattr(PyCodeCache, "modules_no_attr", {}).values())
        found["pycodecache_modules"] = len(modules)
        found["pycodecache_cuda_tensor_mib"] = round(sum(
            v.untyped_storage().nbytes() for m in modules for v in vars(m).values()
            if isinstance(v, torch.Tensor) and v.is_cuda) / 2**20, 1)
    except Exception as error:  # noqa: BLE001 - a diagnostic
        found["pycodecache"] = repr(error)[:200]
    try:
        from torch._dynamo.precompile_context import PrecompileContext
        found["precompile_context"] = [len(PrecompileContext._backend_artifacts_by_key),
                                       len(PrecompileContext._dynamo_cache_entries)]
    except Exception as error:  # noqa: BLE001
        found["precompile_context"] = repr(error)[:200]
    return found


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


def load_compile_and_run(seed: int, precompile: bool, side: int, before: float) -> dict:
    """One checkpoint (this seed's weights): built on the GPU, compiled, called 3 times, dropped."""
    from diffusers import UNet2DConditionModel
    from overdrive.api import CompileOptions, compile_
    torch.manual_seed(seed)
    with torch.device("cuda"):
        unet = UNet2DConditionModel(sample_size=side, **{k: v for k, v in UNET.items() if k != "sample_size"})
    unet = unet.half().eval().requires_grad_(False)
    step = {"seed": seed, "allocated_with_weights_mib": allocated_mib() - before}
    compile_(unet, CompileOptions(precompile=precompile))
    x = torch.randn(2, 4, side, side, device="cuda", dtype=torch.half)
    cond = {"encoder_hidden_states": torch.randn(2, 77, 2048, device="cuda", dtype=torch.half),
            "added_cond_kwargs": {"text_embeds": torch.randn(2, 1280, device="cuda", dtype=torch.half),
                                  "time_ids": torch.full((2, 6), float(side * 8), device="cuda", dtype=torch.half)}}
    with torch.inference_mode():
        for _ in range(3):
            unet(x, torch.tensor([500.0, 500.0], device="cuda"), **cond, return_dict=False)
    step["after_3_calls_mib"] = allocated_mib() - before
    del unet, x, cond
    step["held_after_drop_mib"] = allocated_mib() - before
    return step


def run(precompile: bool, side: int, checkpoints: int) -> dict:
    from overdrive.compiler import clear_shared_graphs
    before = allocated_mib()
    # One checkpoint after another, as a checkpoint change in ComfyUI does: same architecture (the in-memory graph is
    # reused), new weights at new addresses.
    steps = [load_compile_and_run(seed, precompile, side, before) for seed in range(checkpoints)]
    row = {"precompile": precompile, "checkpoints": steps, "held_after_drop_mib": steps[-1]["held_after_drop_mib"],
           "guard_temporaries_left": guard_temporaries()}
    if row["held_after_drop_mib"] > 1:  # what the in-memory graphs keep of a model they no longer serve
        row["largest_live_after_drop"] = live_cuda_tensors()
    clear_shared_graphs()
    row["held_after_clear_shared_graphs_mib"] = allocated_mib() - before
    torch._inductor.cudagraph_trees.reset_cudagraph_trees()
    row["held_after_reset_cudagraph_trees_mib"] = allocated_mib() - before
    torch._dynamo.reset()
    row["held_after_dynamo_reset_mib"] = allocated_mib() - before
    row["suspects"] = suspects()
    row["largest_live_after_reset"] = live_cuda_tensors()
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", type=int, default=128, help="latent side (128: 1024² images)")
    parser.add_argument("--variants", default="precompile,plain", help="precompile and/or plain, in that order")
    parser.add_argument("--checkpoints", type=int, default=1, help="models of the same architecture, one after another")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = {"benchmark": "memory_after_release", "environment": environment(), "unet": UNET, "side": args.side,
              "results": []}
    for precompile in [kind == "precompile" for kind in args.variants.split(",")]:
        row = run(precompile, args.side, args.checkpoints)
        report["results"].append(row)
        print(json.dumps(row), flush=True)
        write_report(report, args.out)


if __name__ == "__main__":
    main()

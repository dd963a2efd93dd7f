"""What does a failed graph capture leave? A dead pool, its memory, a stuck RNG (logs/2026-12-01_h200_capture_failure_probe.jsonl).

A capture invalidated by a host read, then by hand: the allocator's routing into the pool ended, the pool released,
the graph dropped; then a new capture into the same pool and into a new one. One case a process, a JSON line each.
Analysis: bench/experiments/memory-budgets.md.

  for case in plain end end-drop end-release-drop release-drop; do python3 bench/probes/capture_failure_probe.py $case; done
"""
import gc
import json
import sys

import torch


def gib(nbytes: int) -> float:
    return round(nbytes / 2**30, 3)


def memory() -> dict:
    return {"allocated": gib(torch.cuda.memory_allocated()), "reserved": gib(torch.cuda.memory_reserved())}


def attempt(call) -> str:
    try:
        call()
        return "ok"
    except Exception as error:  # noqa: BLE001 - what each call raises is the finding
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def failed_capture(pool, stream):
    """A capture that allocates 1 GiB in `pool`, then is invalidated by a host read."""
    graph = torch.cuda.CUDAGraph()
    found = {}
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        held = torch.ones(2**28, device="cuda")  # 1 GiB, from the graph's pool
        found["host read"] = attempt(lambda: held.sum().item())
        found["capture_end"] = attempt(graph.capture_end)
    del held
    return graph, found


def main(case: str) -> None:
    device = torch.cuda.current_device()
    pool = torch.cuda.graph_pool_handle()
    before = memory()
    graph, found = failed_capture(pool, torch.cuda.Stream())
    if "end" in case.split("-"):
        found["endAllocateToPool"] = attempt(lambda: torch._C._cuda_endAllocateToPool(device, pool))
    if "release" in case.split("-"):
        found["releasePool"] = attempt(lambda: torch._C._cuda_releasePool(device, pool))
    if "drop" in case.split("-"):
        del graph
        gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = memory()
    x = torch.ones(4, device="cuda")

    def record_into(into):
        again = torch.cuda.CUDAGraph()
        with torch.cuda.stream(torch.cuda.Stream()):
            again.capture_begin(pool=into)
            y = x * 2
            again.capture_end()
        again.replay()
        torch.cuda.synchronize()
        assert y.sum().item() == 8
    found["a new capture into the same pool"] = attempt(lambda: record_into(pool))
    found["a new capture into a new pool"] = attempt(lambda: record_into(torch.cuda.graph_pool_handle()))
    print(json.dumps({"case": case, "torch": torch.__version__, "memory before": before,
                      "after, cache emptied": after, **found}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

"""Does a CUDA graph holding NCCL work block leaving the group? Yes, until freed (2026-12-03_h200_nccl_graph_teardown_probe.log).

One NCCL process, a graph holding an all-to-all, one way of leaving per run (pytorch/pytorch#115388).
Analysis: bench/experiments/parallel-model.md.

  python3 bench/probes/nccl_graph_teardown_probe.py keep-destroy | free-destroy | keep-abort | none-destroy
"""
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

how = sys.argv[1]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
x = torch.randn(4, 1024, device="cuda")


def step(x):
    return functional.all_to_all_single(x * 2, None, None, dist.group.WORLD) + 1  # waits as it is read


expected = step(x)  # eager, which also creates the communicator before a capture
torch.cuda.synchronize()
graph = None
if how != "none-destroy":
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)
    graph.replay()
    torch.cuda.synchronize()
    print("replayed, equal:", torch.equal(out, expected), flush=True)
if how == "free-destroy":
    del graph, out
    torch.cuda.synchronize()
started = time.perf_counter()
if how.endswith("abort"):
    dist.distributed_c10d._abort_process_group()
else:
    dist.destroy_process_group()
print(f"{how}: left the group in {time.perf_counter() - started:.2f} s", flush=True)

"""Run in a fresh process by test_compile_cache: compile a small module with Overdrive's disk cache, print counters."""
import json
import logging
import sys

import torch
import torch.nn as nn

logging.basicConfig(level=logging.INFO)  # before the import: overdrive.compiler logs its Redis set-up on import
from overdrive.compiler import CompileDiskCache, compile_module, set_disk_cache  # noqa: E402

set_disk_cache(None if sys.argv[1] == "none" else CompileDiskCache(sys.argv[1]))
torch.manual_seed(0)
module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval().requires_grad_(False)
expected = module(torch.ones(4, 16))
compiled = compile_module(module)
out = module(torch.ones(4, 16))
counters = torch._dynamo.utils.counters["inductor"]
print(json.dumps({"hits": counters["fxgraph_cache_hit"], "misses": counters["fxgraph_cache_miss"],
                  "graphs": compiled.graph.graphs_compiled, "failure": compiled.graph.failure,
                  "max_error": (out - expected).abs().max().item()}))

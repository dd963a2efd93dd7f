"""Run in a fresh process by test_compile_cache: compile a small module with Overdrive's disk cache, print counters.

argv: cache folder (or "none"); env OVERDRIVE_TEST_PRECOMPILE=1 compiles with CompileOptions(precompile=True),
OVERDRIVE_TEST_PATCH_GELU=1 replaces torch's gelu first (as a node that patches a function would),
OVERDRIVE_TEST_TWO_SHAPES=1 compiles one graph per shape for two shapes (dynamic="static"), OVERDRIVE_TEST_SCALE sets a
module-level value the model reads (default 1)."""
import json
import logging
import os
import sys

import torch
import torch.nn as nn

logging.basicConfig(level=logging.INFO)  # Overdrive logs its Redis set-up before the first compile
if sys.argv[1] == "none":
    os.environ["OVERDRIVE_DISK_CACHE"] = "0"
from overdrive.compiler import CompileOptions, compile_module  # noqa: E402

if os.environ.get("OVERDRIVE_TEST_PATCH_GELU") == "1":  # what a custom node patching a torch function does at import
    torch.nn.functional.gelu = lambda x, approximate="none": torch.tanh(x)
SCALE = float(os.environ.get("OVERDRIVE_TEST_SCALE", "1"))  # a module-level value, as ComfyUI's flags are


class Scaled(nn.Module):
    def forward(self, x):
        return x * SCALE


two_shapes = os.environ.get("OVERDRIVE_TEST_TWO_SHAPES") == "1"
options = CompileOptions(precompile=os.environ.get("OVERDRIVE_TEST_PRECOMPILE") == "1",
                         cache_dir=None if sys.argv[1] == "none" else sys.argv[1],
                         dynamic="static" if two_shapes else "auto")


def checkpoint(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), Scaled(), nn.Linear(32, 16)).eval().requires_grad_(False)


module, second = checkpoint(0), checkpoint(1)  # two checkpoints of one architecture
x = torch.ones(4, 16)
expected, expected_second = module(x), second(x)
compiled = compile_module(module, options)
out = module(x)
compile_module(second, options)
out_second = second(x)  # the same compiled code, the second checkpoint's weights
if two_shapes:  # a second graph of the same entry point
    wide = torch.ones(7, 16)
    assert torch.allclose(module(wide), compiled.eager(wide), atol=1e-5)
counters = torch._dynamo.utils.counters
print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "graphs": compiled.graph.graphs_compiled, "failure": compiled.graph.failure,
                  "traced": counters["stats"]["unique_graphs"],
                  "max_error": max((out - expected).abs().max().item(), (out_second - expected_second).abs().max().item())}))

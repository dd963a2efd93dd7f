"""Regional compilation on ComfyUI's real transformer blocks: each block shape is compiled once, every block keeps
its own weights, blocks with attention patches run inline, and a failing region falls back to a whole graph."""
import logging

import pytest
import torch

from test_compile_core import relative_error

from overdrive.comfy_host.comfy_call_options import COMFY_CALL_OPTIONS
from overdrive.compiler import CompileOptions, clear_shared_graphs, compile_module, regions

DEPTH = 3


@pytest.fixture
def transformer(comfy):  # conftest's `comfy`: ComfyUI's real modules, imported in this process
    """ComfyUI's SpatialTransformer with DEPTH BasicTransformerBlocks, each with its own random weights."""
    from comfy.ldm.modules.attention import SpatialTransformer

    torch.manual_seed(0)
    module = SpatialTransformer(64, 2, 32, depth=DEPTH, context_dim=48, use_linear=True,
                                operations=comfy.ops.disable_weight_init)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    clear_shared_graphs()
    torch._dynamo.reset()
    yield module.requires_grad_(False)
    clear_shared_graphs()


def inputs():
    torch.manual_seed(1)
    return torch.randn(2, 64, 8, 8), torch.randn(2, 7, 48)


def traced_regions(module, transformer_options):
    """Run `module` under torch.compile with a backend that records Dynamo's graph; returns (output, the subgraph
    name of every region call)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, context = inputs()
    out = torch.compile(module, backend=record)(x, context=context, transformer_options=transformer_options)
    calls = [node.args[1] for gm in graphs for node in gm.graph.nodes
             if node.op == "call_function" and "invoke_subgraph" in str(node.target)]
    return out, calls


def test_each_block_shape_is_traced_once_and_every_block_keeps_its_weights(transformer):
    x, context = inputs()
    expected = transformer(x, context=context, transformer_options={})
    assert regions.install_regions(transformer, COMFY_CALL_OPTIONS) == DEPTH
    out, calls = traced_regions(transformer, {"block": ("input", 4), "block_index": 0})
    assert len(calls) == DEPTH and len(set(calls)) == 1  # three calls of one compiled subgraph
    # Distinct weights per block: a region that reused the first block's weights would be far off.
    assert relative_error(out, expected) < 1e-5
    regions.uninstall_regions(transformer)
    assert all("forward" not in block.__dict__ for block in transformer.transformer_blocks)


def test_a_block_with_an_attention_patch_runs_inline_with_it(transformer):
    def double_attention_output(n, extra_options):
        return n * 2

    options = {"patches": {"attn1_output_patch": [double_attention_output]}}
    x, context = inputs()
    expected = transformer(x, context=context, transformer_options=options)
    assert relative_error(expected, transformer(x, context=context, transformer_options={})) > 1e-3
    regions.install_regions(transformer, COMFY_CALL_OPTIONS)
    out, calls = traced_regions(transformer, options)
    assert calls == []  # the patch is applied inside each block, so no block runs as a shared region
    assert relative_error(out, expected) < 1e-5


def test_regions_failing_to_compile_fall_back_to_one_whole_graph(transformer, monkeypatch, caplog):
    x, context = inputs()
    expected = transformer(x, context=context, transformer_options={})

    def broken_region(block, *args, **kwargs):
        raise RuntimeError("region failure injected by the test")

    monkeypatch.setattr(regions, "_forwards_by_class", {})
    monkeypatch.setattr(regions, "_nested_region", lambda run_block: broken_region)
    compiled = compile_module(transformer, CompileOptions(backend="aot_eager", cuda_graphs=False,
                                                        call_options=COMFY_CALL_OPTIONS))
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        out = transformer(x, context=context, transformer_options={})
    assert any("with regions failed" in r.getMessage() for r in caplog.records)
    assert not compiled.options.regional and compiled.graph.failure is None and compiled.graph.graphs_compiled >= 1
    assert all("forward" not in block.__dict__ for block in transformer.transformer_blocks)
    assert relative_error(out, expected) < 1e-5

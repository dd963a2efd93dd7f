"""The compiler core on plain torch modules: shared graphs per architecture, eager fallback, no ComfyUI."""
import logging

import pytest
import torch
import torch.nn as nn

from overdrive.compiler import (CompileOptions, architecture_fingerprint, clear_shared_graphs, compile_module,
                                uncompile_module)


class Block(nn.Module):
    def __init__(self, channels=8):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(2, channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x, scale=None):
        h = torch.nn.functional.silu(self.norm(self.conv(x)))
        h = self.proj(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x + h * (scale if scale is not None else 1.0)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def seeded_block(seed):
    torch.manual_seed(seed)
    return Block().eval().requires_grad_(False)


@pytest.fixture(autouse=True)
def fresh_graphs():
    clear_shared_graphs()
    torch._dynamo.reset()
    yield
    clear_shared_graphs()


def test_fingerprint_ignores_weights_but_not_shapes_or_dtypes():
    a, b = seeded_block(0), seeded_block(1)
    assert architecture_fingerprint(a) == architecture_fingerprint(b)
    assert architecture_fingerprint(a) != architecture_fingerprint(Block(channels=16))
    assert architecture_fingerprint(a) != architecture_fingerprint(seeded_block(0).double())
    assert architecture_fingerprint(a, {"mode": "default"}) != architecture_fingerprint(a, {"mode": "max-autotune"})


def test_second_module_of_same_architecture_runs_without_recompiling():
    first, second = seeded_block(0), seeded_block(1)
    reference = [m(torch.ones(1, 8, 6, 6)) for m in (first, second)]
    x = torch.randn(1, 8, 6, 6)
    expected = [first(x), second(x)]

    compiled_first = compile_module(first)
    out_first = first(x)
    assert compiled_first.graph.graphs_compiled >= 1
    graphs_after_first = compiled_first.graph.graphs_compiled

    compiled_second = compile_module(second)
    assert compiled_second.graph is compiled_first.graph  # one graph per architecture, in memory
    out_second = second(x)
    assert compiled_second.graph.graphs_compiled == graphs_after_first  # zero recompiles for the second checkpoint

    assert relative_error(out_first, expected[0]) < 1e-4
    assert relative_error(out_second, expected[1]) < 1e-4
    assert relative_error(out_first, out_second) > 1e-3  # each ran with its own weights

    # Weights swapped in place or replaced by new Parameters (as ComfyUI's LoRA patching does): no recompile.
    with torch.no_grad():
        first.conv.weight.copy_(second.conv.weight)
    first.proj.weight = nn.Parameter(second.proj.weight.clone(), requires_grad=False)
    first(x)
    assert compiled_first.graph.graphs_compiled == graphs_after_first

    uncompile_module(first)
    assert "forward" not in first.__dict__
    assert relative_error(first(torch.ones(1, 8, 6, 6)), reference[0]) > 0  # runs eager again (weights changed)


def test_compile_failure_falls_back_to_eager_with_a_warning(caplog):
    module = seeded_block(0)
    x = torch.randn(1, 8, 6, 6)
    expected = module(x)
    compiled = compile_module(module, CompileOptions(mode="default"))
    # A real failure: Inductor cannot build its C++ kernels without a working compiler.
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false"), "force_disable_caches": True}):
        with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
            out = module(x, scale=torch.tensor(1.0))
    assert torch.allclose(out, expected)
    assert compiled.graph.failure is not None
    assert any("runs eager from now on" in r.getMessage() for r in caplog.records)
    # Later calls stay on the eager path, without trying to compile again.
    assert torch.allclose(module(x), expected)


def test_a_failure_while_a_cuda_graph_records_is_left_to_the_recorder_and_the_compiled_code_kept(monkeypatch):
    """Out of memory for a CUDA graph's pool inside a compiled block says nothing about its compiled code: the error
    goes to the recorder (compiler/block_graphs.py runs the block without a graph), and the block keeps compiling;
    falling back to eager there ran eager code inside the capture, which failed the prompt."""
    from overdrive.compiler import compiled_method
    module = seeded_block(0)
    x = torch.randn(1, 8, 6, 6)
    expected = module(x)
    compiled = compile_module(module, CompileOptions(mode="default"))
    monkeypatch.setattr(compiled_method, "capturing", lambda: True)
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false"), "force_disable_caches": True}):
        with pytest.raises(Exception):
            module(x)
    assert compiled.graph.failure is None
    monkeypatch.setattr(compiled_method, "capturing", lambda: False)
    assert torch.allclose(module(x), expected, atol=1e-5) and compiled.graph.failure is None
    assert compiled.graph.graphs_compiled >= 1


def test_out_of_memory_runs_that_call_eager_and_keeps_the_compiled_code_until_it_repeats(monkeypatch, caplog):
    """The card out of memory in a compiled call is its state at that moment (another model loaded, a larger batch):
    that call runs eager and the next ones compiled again; only OUT_OF_MEMORY_LIMIT in a row make the architecture
    run eager for good, as any other failure does at once."""
    from overdrive.compiler import compiled_method
    module = seeded_block(0)
    x = torch.randn(1, 8, 6, 6)
    expected = module(x)
    compiled = compile_module(module, CompileOptions(mode="default", regional=False))  # (regions: one more step)
    assert torch.allclose(module(x), expected, atol=1e-5)  # compiled once, for real
    real_call, calls = compiled.graph.call, []

    def short_card(*args, **kwargs):
        calls.append("compiled")
        if len(calls) in failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real_call(*args, **kwargs)
    monkeypatch.setattr(compiled.graph, "call", short_card)
    failing = {1, 3}  # apart: each costs that call only
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        outputs = [module(x) for _ in range(4)]
    assert all(torch.allclose(out, expected, atol=1e-5) for out in outputs)
    assert compiled.graph.failure is None and len(calls) == 4
    assert caplog.text.count("ran out of GPU memory; this call runs eager") == 2
    calls.clear()
    failing = set(range(1, compiled_method.OUT_OF_MEMORY_LIMIT + 1))  # in a row: eager from then on
    outputs = [module(x) for _ in range(compiled_method.OUT_OF_MEMORY_LIMIT + 2)]
    assert all(torch.allclose(out, expected, atol=1e-5) for out in outputs)
    assert compiled.graph.failure is not None and len(calls) == compiled_method.OUT_OF_MEMORY_LIMIT


def test_bad_options_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="choose one of"):
        CompileOptions(mode="fastest")
    with pytest.raises(ValueError, match="choose one of"):
        CompileOptions(dynamic="sometimes")


def test_twin_with_other_weights_runs_the_same_graph_and_leaves_the_original_alone():
    from overdrive.compiler import CompiledMethod, WeightMismatchError, twin_with_weights

    original, donor = seeded_block(0), seeded_block(1)
    x = torch.randn(2, 8, 6, 6)
    expected_original, expected_donor = original(x), donor(x)
    compiled = compile_module(original)
    original(x)
    graphs = compiled.graph.graphs_compiled

    twin = twin_with_weights(original, {k: v.clone() for k, v in donor.state_dict().items()})
    assert "forward" not in twin.__dict__  # the original's compiled forwarder is not copied along
    twin.forward = CompiledMethod(twin)
    assert relative_error(twin(x), expected_donor) < 1e-4
    assert compiled.graph.graphs_compiled == graphs  # no recompile for the new weights
    assert relative_error(original(x), expected_original) < 1e-4  # the original still has its own weights

    bad = dict(donor.state_dict())
    bad["proj.weight"] = torch.zeros(4, 8)
    del bad["conv.bias"]
    with pytest.raises(WeightMismatchError, match=r"missing keys: conv\.bias.*proj\.weight: \(4, 8\) vs \(8, 8\)"):
        twin_with_weights(original, bad)
    with pytest.raises(WeightMismatchError):
        twin_with_weights(original, dict(Block(channels=16).state_dict()))


def test_twin_weights_take_the_running_dtype():
    from overdrive.compiler import twin_with_weights

    original = seeded_block(0).half()
    twin = twin_with_weights(original, seeded_block(1).state_dict())  # float32 checkpoint into an fp16 model
    assert {p.dtype for p in twin.parameters()} == {torch.float16}


def test_twin_leaves_out_the_loaders_state_of_each_layer():
    """A host loader's records on the layers (ComfyUI's dynamic VRAM: handles to pinned host buffers) belong to the
    original's load: never copied (a copied handle is freed twice, which aborted the process) nor shared."""
    from overdrive.compiler import twin_with_weights

    class HostBuffer:
        def __deepcopy__(self, memo):
            raise AssertionError("a loader's handle was copied")

    original = seeded_block(0)
    pins = HostBuffer()
    original.conv._pins, original.proj._pins = pins, {"pin": pins}
    twin = twin_with_weights(original, seeded_block(1).state_dict(), loader_state=("_pins",))
    assert all("_pins" not in layer.__dict__ for layer in twin.modules())
    assert original.conv._pins is pins  # the original keeps its own


def test_resolution_policy_auto_bounds_graphs_across_many_shapes():
    """dynamic='auto': the first shape gets a specialised graph, the second a shape-generic one that serves every
    later resolution; PyTorch specialises size-1 dims, so batch 1 and batch > 1 take one generic graph each: at
    most 3 graphs however many shapes follow."""
    module = seeded_block(0)
    compiled = compile_module(module, CompileOptions(dynamic="auto"))
    shapes = [(1, 8, 6, 6), (1, 8, 10, 6), (2, 8, 8, 12), (1, 8, 14, 14), (3, 8, 6, 10), (2, 8, 16, 8), (1, 8, 12, 4)]
    for shape in shapes:
        x = torch.randn(shape)
        expected = type(module).forward(module, x)
        assert relative_error(module(x), expected) < 1e-4
    assert compiled.graph.failure is None
    assert compiled.graph.graphs_compiled <= 3, compiled.graph.graphs_compiled


class DownsampledTokens(nn.Module):
    """A UNet's first level in small (a stride-2 convolution, then GroupNorm) and a DiT's token projection."""

    def __init__(self, channels=8):
        super().__init__()
        self.down = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, channels)
        self.proj = nn.Linear(channels, channels)

    def forward(self, x, tokens):
        return self.norm(self.down(x)), self.proj(tokens)


def test_resolution_policy_auto_serves_every_later_size_without_a_new_graph(caplog):
    """dynamic='auto': once the shape-generic graph exists, no later size compiles. Its guards refuse sizes where a
    dimension is 1 (a tiny image: GroupNorm's reshape takes another path where the downsampled width is
    1; a single token): those run eager, right, and never compile a graph of their own."""
    torch.manual_seed(0)
    module = DownsampledTokens().eval().requires_grad_(False)
    compiled = compile_module(module, CompileOptions(dynamic="auto", cuda_graphs=False, precompile=False))

    def run(side, tokens):
        x, context = torch.randn(2, 8, side, side), torch.randn(2, tokens, 8)
        for out, expected in zip(module(x, context), compiled.eager(x, context)):
            assert relative_error(out, expected) < 1e-4, (side, tokens)
    run(8, 5)  # specialised
    run(12, 7)  # the shape-generic graph
    graphs = compiled.graph.graphs_compiled
    with caplog.at_level(logging.INFO, logger="overdrive.compiler"):
        for side, tokens in ((16, 9), (2, 5), (1, 5), (8, 1), (20, 3), (2, 5)):
            run(side, tokens)
    assert compiled.graph.graphs_compiled == graphs
    assert len(compiled.graph.eager_shapes) == 3 and caplog.text.count("does not cover this size") == 3, caplog.text


def test_resolution_policy_static_stops_at_max_graphs_and_runs_eager(caplog):
    """dynamic='static': one graph per shape, bounded by max_graphs; a shape beyond the bound runs eager with a
    warning that names the fix, and never compiles."""
    module = seeded_block(0)
    compiled = compile_module(module, CompileOptions(dynamic="static", max_graphs=2))
    for size in (6, 8):
        module(torch.randn(1, 8, size, size))
    assert compiled.graph.graphs_compiled == 2
    x = torch.randn(1, 8, 10, 10)
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        out = module(x)
    assert torch.allclose(out, type(module).forward(module, x))
    assert compiled.graph.graphs_compiled == 2
    assert any("max_graphs" in r.getMessage() and "dynamic='auto'" in r.getMessage() for r in caplog.records)


class ChunkedDecoder(nn.Module):
    """The call pattern of Wan's video VAE decoder: a list of cached frames and a list-held counter, changed in place
    by the call, with work after a graph break."""

    def forward(self, x, cache, index):
        cache[index[0]] = x * 2
        index[0] += 1
        torch._dynamo.graph_break()
        return x + cache[0]


def test_a_failed_compiled_call_is_retried_eager_from_the_list_state_it_started_with():
    from torch._dynamo import register_backend

    graphs = []

    @register_backend(name="overdrive_test_second_graph_fails")
    def second_graph_fails(gm, example_inputs):
        graphs.append(gm)
        if len(graphs) > 1:  # the graph after the break: the first one already ran and changed the lists
            raise RuntimeError("backend failure after the first graph ran")
        return gm.forward

    module = ChunkedDecoder()
    compiled = compile_module(module, CompileOptions(backend="overdrive_test_second_graph_fails", cuda_graphs=False,
                                                     regional=False, precompile=False))
    x, cache, index = torch.ones(2), [None, None], [0]
    out = module(x, cache, index)
    assert len(graphs) == 2 and compiled.graph.failure is not None
    # The eager retry ran once, from the lists as the call received them.
    assert index == [1] and torch.equal(cache[0], x * 2) and cache[1] is None
    assert torch.equal(out, x * 3)


class GeluMLP(nn.Module):
    """tanh-GELU as DiT MLPs write it (a module and a functional call), beside an exact (erf) GELU."""

    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8)

    def forward(self, x):
        h = self.act(self.up(x))
        return self.down(torch.nn.functional.gelu(h, approximate="tanh") + torch.nn.functional.gelu(h))


def test_fast_activations_trace_tanh_gelu_through_a_sigmoid_and_leave_eager_code_alone():
    from torch._dynamo.testing import EagerAndRecordGraphs

    from overdrive.compiler import shared_graph
    from overdrive.compiler.activations import tanh_gelu_via_sigmoid

    x = torch.linspace(-12, 12, 4001, dtype=torch.float64)
    assert torch.allclose(tanh_gelu_via_sigmoid(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-12)
    torch.manual_seed(0)
    module, inp = GeluMLP().eval().requires_grad_(False), torch.randn(4, 8)
    recorder = EagerAndRecordGraphs()
    traced = torch.compile(shared_graph._call_method_fast_activations, backend=recorder, fullgraph=True)
    assert relative_error(traced(module, "forward", (inp,), {}), module(inp)) < 1e-6
    code = recorder.graphs[0].code
    assert code.count("torch.sigmoid(") == 2 and code.count("_nn.gelu(") == 1  # the erf GELU stays as written
    # Through the compiler core (Inductor on the CPU), and the eager fallback runs torch's own GELU.
    compiled = compile_module(module, CompileOptions(cuda_graphs=False, precompile=False, fast_activations=True))
    assert relative_error(module(inp), compiled.eager(inp)) < 1e-6
    traced_code = compiled.graph.compiled._torchdynamo_orig_callable.__code__
    assert traced_code.co_code == shared_graph._call_method_fast_activations.__code__.co_code

"""What decides whether a DiT block's CUDA graph is replayed (compiler/block_graphs.py), on the CPU: the call
signature tells shapes, dtypes, plain values and object identities apart, and a call on CPU tensors runs the block as
it is. The recordings themselves are checked on a GPU (test_block_graphs_gpu.py)."""
import torch

from overdrive.compiler.block_graphs import BlockGraphs, _flatten, _rebuilt
from overdrive.families import BlockStack


def signature(*args, **kwargs):
    tensors, objects = [], []
    return (_flatten(args, tensors, objects), _flatten(kwargs, tensors, objects)), tensors


def test_the_signature_is_equal_for_equal_calls_and_differs_in_each_thing_a_graph_bakes_in():
    x, pe, marker = torch.zeros(2, 8), torch.zeros(1, 8), object()
    base, tensors = signature(x, pe=(pe, pe), mask=None, options={"override": marker}, scale=1.0)
    assert len(tensors) == 3
    assert signature(torch.ones(2, 8), pe=(pe, pe), mask=None, options={"override": marker}, scale=1.0)[0] == base
    for other in (signature(torch.zeros(3, 8), pe=(pe, pe), mask=None, options={"override": marker}, scale=1.0),
                  signature(x.half(), pe=(pe, pe), mask=None, options={"override": marker}, scale=1.0),
                  signature(x, pe=(pe, pe), mask=x, options={"override": marker}, scale=1.0),
                  signature(x, pe=(pe, pe), mask=None, options={"override": object()}, scale=1.0),
                  signature(x, pe=(pe, pe), mask=None, options={"override": marker}, scale=2.0),
                  signature(x, pe=[pe, pe], mask=None, options={"override": marker}, scale=1.0)):
        assert other[0] != base
    assert signature(x, flag=True)[0] != signature(x, flag=1)[0]  # equal in Python, not to a graph


def test_rebuilt_puts_tensors_back_in_the_arguments_order():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    rebuilt = _rebuilt((a, {"k": (b, 3)}, [c]), iter([c, a, b]))
    assert rebuilt[0] is c and rebuilt[1]["k"][0] is a and rebuilt[1]["k"][1] == 3 and rebuilt[2][0] is b


@torch.inference_mode()
def test_a_call_on_the_cpu_runs_the_block_and_records_nothing():
    block = torch.nn.Linear(4, 4)
    graphs = BlockGraphs()
    stack = BlockStack("blocks", streams=(("x", 0),), returns=("x",))
    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.equal(graphs.call("blocks.0", block, stack, block.forward, (x,), {}), block(x))
    assert graphs.recorded == 0 and graphs.replays == 0


def test_weight_functions_set_after_the_recording_change_what_the_replay_is_keyed_on():
    """ComfyUI gives a layer it keeps off the GPU `weight_function` patches (low-VRAM LoRA): the weights' addresses
    may stay, so the key says whether any layer has them, and such a block is not recorded."""
    from overdrive.compiler.block_graphs import _BlockWeights

    block = torch.nn.Sequential(torch.nn.Linear(2, 2))
    block[0].weight_function, block[0].bias_function = [], []
    weights = _BlockWeights(block)
    before = weights.pointers()
    assert weights.why_not(torch.device("cpu")) is None
    block[0].weight_function = [lambda w: w * 2]
    assert weights.pointers() != before
    assert "weight patches" in weights.why_not(torch.device("cpu"))
    assert "weights are on cpu" in _BlockWeights(torch.nn.Linear(2, 2)).why_not(torch.device("meta"))

"""Adding a model family is one file: this one. A toy DiT declares its block stack with `register(Family(...))`, and
Overdrive's verbs (overdrive.api, on the bare module) compile it block by block, step-cache it, quantize it and split
its CFG batch over processes, with nothing added anywhere else. (The sequence split reads a layout rule that a family
declares for diffusers' and ComfyUI's classes, parallel/split_rules.py; the toy declares none.)"""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from overdrive.api import (CompileOptions, DeepCacheConfig, ParallelConfig, QuantConfig, compile_, deepcache_,
                           parallelize_, quantize_)
from overdrive.compiler import dynamo_graph_count
from overdrive.core.blockwise import BlockwiseForward
from overdrive.families import FAMILIES, BlockStack, Family, family_of, register, registered

WIDTH, DEPTH, TOKENS = 64, 6, 16


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, scale):
        return x + self.mlp(self.norm(x)) * scale


class ToyDiT(nn.Module):
    """x: (batch, tokens, width); timestep: (batch,) from 1 (noise) to 0."""

    def __init__(self):
        super().__init__()
        self.time = nn.Linear(1, WIDTH)
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(DEPTH))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, timestep):
        scale = torch.sigmoid(self.time(timestep.reshape(-1, 1).to(x.dtype)))[:, None]
        for block in self.blocks:
            x = block(x, scale)
        return self.out(x)


TOY = Family("toy", frozenset({"ToyDiT"}), (
    BlockStack("blocks", streams=(("x", 0),), returns=("x",)),
), display_name="Toy DiT")


@pytest.fixture(autouse=True, scope="module")
def toy_family():
    """Registered as a family's module registers itself when imported (`register(Family(...))`); here only while
    these tests run, so that the family names other tests read (the nodes' descriptions) stay those Overdrive ships."""
    register(TOY)
    yield TOY
    for name in TOY.classes:
        FAMILIES.pop(name)


def toy(seed=0) -> ToyDiT:
    torch.manual_seed(seed)
    return ToyDiT().eval()


def relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def calls(steps=4):
    x = torch.randn(2, TOKENS, WIDTH, generator=torch.Generator().manual_seed(1))
    return [(x, torch.full((2,), 1 - i / steps)) for i in range(steps)]


def test_the_family_is_registered_once_and_found_by_its_class():
    assert family_of(toy()) is TOY and sum(family is TOY for family in registered()) == 1
    assert TOY.title == "Toy DiT"


def test_compile_runs_every_block_through_one_graph_and_matches_eager():
    eager, model = toy(), toy()
    before = dynamo_graph_count()
    compile_(model, CompileOptions(precompile=False, cuda_graphs=False))
    assert isinstance(model.forward, BlockwiseForward) and len(model.forward.compiled) == DEPTH
    with torch.no_grad():
        for x, t in calls(2):
            assert relative_error(model(x, timestep=t), eager(x, timestep=t)) < 1e-4
    assert dynamo_graph_count() - before == 1  # one graph serves the six blocks


def test_the_step_cache_reuses_the_deep_blocks_on_later_steps():
    eager, model = toy(), toy()
    cache = deepcache_(model, DeepCacheConfig(mode="fixed", cache_interval=2, cache_depth=1))
    with torch.no_grad():
        outputs = [(model(x, timestep=t), eager(x, timestep=t)) for x, t in calls(4)]
    assert cache.stats.full_steps + cache.stats.shallow_steps == 4 and cache.stats.shallow_steps >= 1
    assert relative_error(*outputs[0]) < 1e-6  # the first step is full: exact
    assert any(relative_error(cached, full) > 1e-6 for cached, full in outputs[1:])  # some step reused its residual


def test_quantize_puts_8_bit_kernels_in_the_blocks_within_their_error():
    eager, model = toy(), toy()
    x, t = calls(1)[0]
    report = quantize_(model, QuantConfig(format="int8", compute_density_threshold=0, min_speedup=0),
                       calibration=lambda: model(x, timestep=t))
    assert report.quantized and all(name.startswith(("blocks.", "out", "time")) for name in report.quantized)
    with torch.no_grad():
        assert relative_error(model(x, timestep=t), eager(x, timestep=t)) < 0.05


def _split_over_two_processes(rank: int, rendezvous: str, results: str) -> None:
    register(TOY)  # a process of its own: the family registers as its module would at import
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        eager, model = toy(), toy()
        compile_(model, CompileOptions(precompile=False, cuda_graphs=False))
        parallelize_(model, ParallelConfig(mode="cfg"))
        x, t = calls(1)[0]  # a batch of two: the cond and uncond passes CFG batches
        with torch.no_grad():
            error = relative_error(model(x, timestep=t), eager(x, timestep=t))
        torch.save(error, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def test_cfg_parallelism_splits_its_calls_over_two_processes(tmp_path):
    """Every process runs the batch entry of its own rank through the compiled blocks and ends with the whole output
    (a gloo group on the CPU, as torchrun would start it)."""
    results = str(tmp_path / "error")
    mp.spawn(_split_over_two_processes, args=(str(tmp_path / "rendezvous"), results), nprocs=2)
    assert all(torch.load(f"{results}.{rank}") < 1e-4 for rank in range(2))

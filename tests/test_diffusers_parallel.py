"""parallelize_ (overdrive.api) on real diffusers pipelines, in processes of a gloo group on the CPU as torchrun would
start them: every transformer call split over 2 processes (the batch of SD3's CFG; the image tokens of Flux, Wan,
SD3 and Qwen-Image) equals the transformer alone on the same inputs, also compiled and step-cached."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffusers_tiny import dit_prompt, flux_prompt, tiny_flux_pipeline, tiny_qwen_image_pipeline, tiny_sd3_pipeline
from diffusers_tiny import tiny_unet, tiny_wan_pipeline
from overdrive.api import (CompileOptions, DeepCacheConfig, ParallelConfig, QuantConfig, compile_, deepcache_,
                           parallelize_, quantize_)
from overdrive.compiler import dynamo_graph_count

PIPELINES = {"flux": tiny_flux_pipeline, "wan": tiny_wan_pipeline, "qwen_image": tiny_qwen_image_pipeline,
             "sd3": tiny_sd3_pipeline}
# (family, mode, the split each call takes): SD3 batches its CFG passes, the others call the transformer per pass
CASES = [("flux", "auto", "sequence"), ("wan", "auto", "sequence"), ("qwen_image", "sequence", "sequence"),
         ("sd3", "auto", "cfg"), ("sd3", "sequence", "sequence")]
STEPS = 2


def relative_error(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def generate(pipe, family, steps=STEPS, height=32):
    out = pipe(**(flux_prompt() if family == "flux" else dit_prompt(family)), height=height, width=32,
               num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(1))
    return out.frames if family == "wan" else out.images


def recorded(pipe, family, steps=STEPS, height=32) -> tuple:
    """(latents, [(kwargs, output)] of every transformer call) of one generation through the installed forward."""
    transformer, calls = pipe.transformer, []
    installed = transformer.__dict__["forward"]

    def record(*args, **kwargs):
        assert not args  # the pipelines pass everything by name
        out = installed(**kwargs)
        calls.append((kwargs, out[0].clone()))
        return out
    transformer.forward = record
    try:
        return generate(pipe, family, steps, height), calls
    finally:
        transformer.forward = installed


def in_group(rank: int, world: int, rendezvous: str, check) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        check()
    finally:
        dist.destroy_process_group()


def run_in_processes(tmp_path, check, world: int = 2) -> None:
    mp.spawn(in_group, args=(world, str(tmp_path / "rendezvous"), check), nprocs=world)


def each_family_split(log_path: str, cases: list, height: int = 32) -> None:
    import logging
    world = dist.get_world_size()
    logging.getLogger("overdrive").addHandler(logging.FileHandler(f"{log_path}.{dist.get_rank()}"))
    logging.getLogger("overdrive").setLevel(logging.INFO)
    for family, mode, split in cases:
        pipe = PIPELINES[family]()
        expected = generate(pipe, family, height=height)
        parallelize_(pipe, ParallelConfig(mode=mode))
        latents, calls = recorded(pipe, family, height=height)
        transformer = pipe.transformer
        with torch.no_grad():
            errors = [relative_error(out, type(transformer).forward(transformer, **kwargs)[0])
                      for kwargs, out in calls]
        assert calls and max(errors) < 1e-5, (family, mode, errors)
        assert relative_error(latents, expected) < 1e-5, family
        with open(f"{log_path}.{dist.get_rank()}") as log:
            assert f"{type(transformer).__name__}: {split} parallelism over {world} processes" in log.read(), family


def unet_cfg_split() -> None:
    """A diffusers UNet (SD's, SDXL's) called on CFG's batch of 2, as its pipelines call it: a pass per process."""
    unet = tiny_unet(0)
    g = torch.Generator().manual_seed(2)
    sample, context = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 16, 32, generator=g)
    with torch.no_grad():
        expected = unet(sample, torch.tensor(500.0), encoder_hidden_states=context).sample
        parallelize_(unet, ParallelConfig(mode="auto"))
        out = unet(sample, torch.tensor(500.0), encoder_hidden_states=context).sample
        alone = unet(sample[:1], torch.tensor(500.0), encoder_hidden_states=context[:1]).sample  # runs whole
    assert relative_error(out, expected) < 1e-5
    assert relative_error(alone, expected[:1]) < 1e-5


def quantized_by_process_0s_decisions() -> None:
    """quantize_ in every process of the group: process 0 calibrates and decides, the other takes its decisions, so
    the shards run the same 8-bit layers; split by tokens, each call equals the quantized transformer alone."""
    pipe = tiny_flux_pipeline()
    report = quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0),
                       calibration={**flux_prompt(), "height": 32, "width": 32, "num_inference_steps": 2})
    reports = [None, None]
    dist.all_gather_object(reports, (sorted(report.quantized), report.calibrated))
    assert reports[0][0] == reports[1][0] and reports[0][0]  # the same layers, some of them
    assert [calibrated for _, calibrated in reports] == [True, False]
    parallelize_(pipe, ParallelConfig(mode="sequence"))
    _, calls = recorded(pipe, "flux")
    transformer = pipe.transformer
    with torch.no_grad():
        errors = [relative_error(out, type(transformer).forward(transformer, **kwargs)[0]) for kwargs, out in calls]
    assert max(errors) < 1e-5, errors


def both_checks(log_path: str) -> None:
    each_family_split(log_path, CASES)
    unet_cfg_split()
    quantized_by_process_0s_decisions()


def test_each_familys_calls_split_over_two_processes_equal_the_transformer_alone(tmp_path):
    """Flux, Wan, Qwen-Image and SD3 pipelines by their tokens (SD3 by its CFG batch too), a UNet by its batch, and
    Flux quantized by process 0's decisions."""
    run_in_processes(tmp_path, functools.partial(both_checks, str(tmp_path / "log")))
    log = (tmp_path / "log.1").read_text()
    assert "UNet2DConditionModel: cfg parallelism over 2 processes" in log
    assert "UNet2DConditionModel: its batch of 1 does not divide over 2 processes; 2 processes do not form" in log
    assert "(ulysses attention, 2 heads)" in (tmp_path / "log.0").read_text()


def test_heads_that_do_not_divide_over_three_processes_attend_over_every_processs_keys(tmp_path):
    """The tiny transformers' 2 heads over 3 processes: each gathers every process's keys and values (SD3's text
    after its image tokens, moved first for the split); 96 image tokens at 48x32."""
    cases = [("sd3", "sequence", "sequence")]
    run_in_processes(tmp_path, functools.partial(each_family_split, str(tmp_path / "log"), cases, 48), world=3)
    assert "(gathered keys attention, 2 heads)" in (tmp_path / "log.2").read_text()


def test_four_processes_split_sd3s_cfg_batch_in_two_and_each_entrys_tokens_in_two(tmp_path):
    """SD3's pipeline batches CFG's two passes: over 4 processes each pass goes to a group of 2 that splits its
    tokens ("both", what auto picks here)."""
    run_in_processes(tmp_path, functools.partial(each_family_split, str(tmp_path / "log"), [("sd3", "auto", "both")]),
                     world=4)
    assert "both parallelism over 4 processes (ulysses attention, 2 heads)" in (tmp_path / "log.3").read_text()


def compiled_and_step_cached() -> None:
    """Wan's blocks compiled with the all-to-alls inside, the adaptive step cache deciding over both shards: the
    same steps reused as the eager transformer in one process reuses, each call within compilation's error of it."""
    pipe = tiny_wan_pipeline()
    cache = deepcache_(pipe, DeepCacheConfig(mode="adaptive", threshold=0.5, cache_depth=1))
    expected_latents, expected_calls = recorded(pipe, "wan", steps=4)
    expected_decisions = list(cache.stats.decisions)
    assert True in expected_decisions and False in expected_decisions
    parallelize_(pipe, ParallelConfig(mode="sequence"))
    compile_(pipe, CompileOptions(precompile=False))
    before = dynamo_graph_count()
    latents, calls = recorded(pipe, "wan", steps=4)
    assert dynamo_graph_count() - before == 1  # Wan's block, the all-to-alls traced into it
    assert cache.stats.decisions == expected_decisions
    assert len(calls) == len(expected_calls)
    for (_, out), (_, expected) in zip(calls, expected_calls):
        assert relative_error(out, expected) < 1e-4
    assert relative_error(latents, expected_latents) < 1e-4
    gathered = [torch.zeros(len(expected_decisions)) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor(cache.stats.decisions, dtype=torch.float32))
    assert torch.equal(gathered[0], gathered[1])  # every process reused the same steps


def test_compiled_and_step_cached_wan_split_by_tokens_equals_it_in_one_process(tmp_path):
    run_in_processes(tmp_path, compiled_and_step_cached)


def test_parallelize_needs_a_process_group_and_a_parallel_config_and_changes_nothing_otherwise():
    pipe = tiny_flux_pipeline()
    with pytest.raises(RuntimeError, match="torchrun"):
        parallelize_(pipe)
    with pytest.raises(TypeError, match="ParallelConfig"):
        parallelize_(pipe, {"mode": "cfg"})
    with pytest.raises(ValueError, match="unknown parallel mode 'ring'"):
        ParallelConfig(mode="ring")
    assert "forward" not in pipe.transformer.__dict__

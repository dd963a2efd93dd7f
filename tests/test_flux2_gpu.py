"""Flux.2 on a GPU, through the nodes tests/test_dit_families.py runs on the other families on the CPU: the built-in
tiny file (one double and one single block at Flux.2's fixed width, 2.3 B parameters: too large for the CPU suite)
loaded by ComfyUI's own loader and sampled by its sampler: Compile Model, the step cache over it, Switch Diffusion
Model, QuantizeModel fp8. Flux.2's blocks take no vector: three global layers make their modulations once per call and
pass them as tuples of ComfyUI's ModulationOut records.

Skipped without CUDA (CI has no GPU); run on the GPU machine with `python3 -m pytest tests/test_flux2_gpu.py`."""
import logging

import pytest
import torch

from overdrive.compiler import dynamo_graph_count
# The CPU suite's fixtures (files of seeds 0 and 1, the loaded model, its sampler at 64 px, eager's calls, the compiled
# model) and its Switch Diffusion Model test, here for Flux.2 on the GPU through this module's `comfy`, `family` and
# `per_call_tolerance`.
from test_dit_families import (assert_calls_match, base, compiled, distinct_blocks, eager, first_file,  # noqa: F401
                               second_file, models_folder, nodes, quantize_every_layer, relative_error, sample,
                               test_switch_diffusion_model_swaps_in_another_file_of_the_family_without_recompiling)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PER_CALL_TOLERANCE = 2e-2  # compiled vs eager in bf16 (the full 32 B model measures ~1e-2)
FP8_TOLERANCE = 0.1


@pytest.fixture(scope="module")
def comfy():
    from overdrive.harness.inprocess import import_comfy
    return import_comfy(cpu=False)


@pytest.fixture(scope="module")
def family():
    return "flux2"


@pytest.fixture(scope="module")
def composition():
    """The CPU suite runs its compositions on a few families; here they run on Flux.2."""


@pytest.fixture(scope="module")
def per_call_tolerance():
    return PER_CALL_TOLERANCE


def test_the_builtin_file_loads_as_flux2(base):
    assert type(base.model.model_config).__name__ == "Flux2"
    assert base.model.diffusion_model.params.global_modulation


def test_compile_model_compiles_each_distinct_block_once_and_matches_eager_per_call(compiled, sample, eager):
    graphs = dynamo_graph_count()
    out, calls = sample(compiled)
    assert distinct_blocks(compiled) == 2  # a double and a single block
    assert dynamo_graph_count() - graphs <= 2
    error = assert_calls_match(calls, eager[1], PER_CALL_TOLERANCE)
    logging.getLogger("overdrive").info("flux2: compiled per-call error %.2e", error)
    assert torch.isfinite(out).all()
    graphs = dynamo_graph_count()
    sample(compiled)
    assert dynamo_graph_count() == graphs


def test_step_cache_on_the_compiled_model_is_exact_on_full_steps_and_compiles_no_more(nodes, compiled, sample, eager,
                                                                                     caplog):
    sample(compiled)
    graphs = dynamo_graph_count()
    _, compiled_calls = sample(compiled)
    with caplog.at_level(logging.INFO, logger="overdrive"):
        cached = nodes["OverdriveDeepCache"].execute(compiled, mode="fixed", cache_interval=2)[0]
        _, calls = sample(cached)  # step 0 full, step 1 reused
        sample(cached)  # the first run's counts are logged when the next starts
    assert "1 full / 1 shallow" in caplog.text, caplog.text[-2000:]
    assert_calls_match(calls[:1], compiled_calls[:1], 1e-6)
    reused = relative_error(calls[1][2], eager[1][1][2])
    assert 1e-4 < reused < 0.5, reused
    assert dynamo_graph_count() == graphs


def test_quantize_model_fp8_runs_8bit_layers_within_the_error_bound(nodes, base, family, sample, eager):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    report, quantized = quantize_every_layer(nodes, base, family, "fp8_e4m3")
    assert report is not None and report.quantized, "quantizing fell back"
    both = nodes["OverdriveCompileModel"].execute(quantized)[0]
    error = assert_calls_match(sample(both)[1], eager[1], FP8_TOLERANCE)
    logging.getLogger("overdrive").info("flux2: %d layers fp8, compiled per-call error %.2e", len(report.quantized),
                                        error)

"""overdrive.api on real diffusers DiT pipelines (CPU, tiny fixed-seed transformers): Wan, Qwen-Image, SD3, Z-Image,
LTX-Video, Flux.2 and Chroma compile block by block through their family plug-ins and switch to another checkpoint
without compiling again; the DiT step cache (deepcache_) on them and on Flux reads its steps from the timestep diffusers
passes, with classifier-free guidance's two calls per step each reusing their own residuals. Fidelity is checked per
transformer call against the eager transformer on the same inputs."""
import pytest
import torch

from diffusers_tiny import (dit_prompt, flux_prompt, tiny_chroma_pipeline, tiny_flux2_pipeline, tiny_flux_pipeline,
                            tiny_ltx_pipeline, tiny_qwen_image_pipeline, tiny_sd3_pipeline, tiny_wan_pipeline,
                            tiny_zimage_pipeline)
from overdrive.api import CompileOptions, DeepCacheConfig, QuantConfig, compile_, deepcache_, quantize_, switch_weights_
from overdrive.core.blockwise import BlockwiseForward
from overdrive.compiler import dynamo_graph_count
from overdrive.step_cache.block_cache import BlockStepCache

COMPILE_RTOL = 1e-4  # Inductor vs eager, float32 on the CPU (measured ~2e-7)
# A reused call against the full transformer on the same input, interval 2 (measured 3.3-5.6 %; with one residual
# shared by cond and uncond the cond calls measured 7.3-9.6 %). Chroma's tiny transformer moves more between steps:
# 5.6-9.0 % with each branch's own residual, cond and uncond within 0.5 % of each other.
REUSED_RTOL = {"chroma": 0.1}
STEPS = 6
PIPELINES = {"wan": tiny_wan_pipeline, "qwen_image": tiny_qwen_image_pipeline, "sd3": tiny_sd3_pipeline,
             "zimage": tiny_zimage_pipeline, "ltxv": tiny_ltx_pipeline, "flux2": tiny_flux2_pipeline,
             "chroma": tiny_chroma_pipeline}
# Z-Image: 2 refiner blocks, 3 main layers; Flux.2 and Chroma: 1 double, 2 single blocks
BLOCKS = {"wan": 3, "qwen_image": 3, "sd3": 3, "zimage": 5, "ltxv": 3, "flux2": 3, "chroma": 3}
# distinct blocks: SD3's last is "pre-only"
GRAPHS = {"wan": 1, "qwen_image": 1, "sd3": 2, "zimage": 3, "ltxv": 1, "flux2": 2, "chroma": 2}
# true CFG: two calls a step; SD3, Z-Image, LTX-Video: one, on a batch of 2; Flux.2: one, guidance-distilled
CALLS_PER_STEP = {"wan": 2, "qwen_image": 2, "sd3": 1, "zimage": 1, "ltxv": 1, "flux2": 1, "chroma": 2}
LATENT = {"wan": (1, 4, 2, 4, 4), "qwen_image": (1, 4, 1, 4, 4), "sd3": (1, 4, 4, 4), "zimage": (1, 4, 4, 4),
          "ltxv": (1, 8, 2, 4, 4), "flux2": (1, 4, 4, 4), "chroma": (1, 4, 4, 4)}
VIDEO_VAE = {"wan", "qwen_image"}  # families whose VAE is Wan's causal video VAE (compiler/eager_vaes.py)


def relative_error(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def generate(pipe, family):
    out = pipe(**(flux_prompt() if family == "flux" else dit_prompt(family)), height=32, width=32,
               num_inference_steps=STEPS, output_type="latent", generator=torch.Generator().manual_seed(1))
    return out.frames if family in ("wan", "ltxv") else out.images


def recorded_calls(pipe, family):
    """Every transformer call of one generation, as (args, kwargs, output), the installed forward left in place."""
    transformer, calls = pipe.transformer, []
    installed = transformer.__dict__["forward"]

    def record(*args, **kwargs):
        out = installed(*args, **kwargs)
        calls.append((args, kwargs, stacked(out[0]).clone()))
        return out
    transformer.forward = record
    try:
        generate(pipe, family)
    finally:
        transformer.forward = installed
    return calls


def eager_errors(pipe, calls) -> list:
    transformer = pipe.transformer
    with torch.no_grad():
        return [relative_error(out, stacked(type(transformer).forward(transformer, *args, **kwargs)[0]))
                for args, kwargs, out in calls]


def stacked(output):
    """A transformer's output tensor (Z-Image's: a list of one tensor per image)."""
    return torch.stack(output) if isinstance(output, (list, tuple)) else output


@pytest.fixture(params=list(PIPELINES))
def family(request):
    return request.param


def test_compile_runs_every_block_through_one_graph_and_matches_eager(family):
    pipe = PIPELINES[family]()
    expected = generate(pipe, family)
    before = dynamo_graph_count()
    compiled = compile_(pipe, CompileOptions(precompile=False))
    forward = pipe.transformer.forward
    assert isinstance(forward, BlockwiseForward) and compiled["transformer.forward"] is forward
    assert len(forward.compiled) == BLOCKS[family]
    assert relative_error(generate(pipe, family), expected) < COMPILE_RTOL
    assert dynamo_graph_count() - before == GRAPHS[family]
    latent = torch.randn(LATENT[family], generator=torch.Generator().manual_seed(3))
    decoded = pipe.vae.decode(latent).sample
    if family in VIDEO_VAE:  # Wan's causal video VAE (Qwen-Image's too): eager, channels-last convolutions
        assert "vae.decode" not in compiled and "decode" not in pipe.vae.__dict__
        convs = [m for m in pipe.vae.modules() if isinstance(m, torch.nn.Conv3d)]
        assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last_3d) for c in convs)
        return
    assert compiled["vae.decode"].graph.failure is None and compiled["vae.decode"].graph.graphs_compiled >= 1
    assert relative_error(decoded, type(pipe.vae).decode(pipe.vae, latent).sample) < COMPILE_RTOL


def test_step_cache_runs_full_steps_exactly_and_each_cfg_branch_reuses_its_own_residuals(family):
    pipe = PIPELINES[family]()
    cache = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=2))
    assert isinstance(cache, BlockStepCache)
    calls = recorded_calls(pipe, family)
    stats, per_step = cache.stats, CALLS_PER_STEP[family]
    assert stats.decisions == [True, False] * (STEPS // 2)
    assert (stats.full_calls, stats.shallow_calls) == (STEPS // 2 * per_step,) * 2
    errors = eager_errors(pipe, calls)
    full = [e for i, e in enumerate(errors) if stats.decisions[i // per_step]]
    reused = [e for i, e in enumerate(errors) if not stats.decisions[i // per_step]]
    assert full == [0.0] * len(full), errors
    assert 0 < max(reused) < REUSED_RTOL.get(family, 0.065), errors


def test_step_cache_on_the_compiled_transformer_compiles_nothing_more_and_matches_it_eager(family):
    eager = PIPELINES[family]()
    deepcache_(eager, DeepCacheConfig(mode="fixed", cache_interval=2))
    expected = generate(eager, family)
    pipe = PIPELINES[family]()
    compile_(pipe, CompileOptions(precompile=False))
    generate(pipe, family)
    cache = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=2))
    before = dynamo_graph_count()
    assert relative_error(generate(pipe, family), expected) < COMPILE_RTOL
    assert dynamo_graph_count() == before and cache.stats.shallow_steps == STEPS // 2


def test_flux_step_cache_window_and_a_later_compile_keep_the_callers_statistics():
    """The window is a fraction of the timesteps the transformer takes (Flux: t / 1000 in (0, 1]); compile_ after
    deepcache_ keeps the step cache object the caller holds."""
    pipe = tiny_flux_pipeline()
    cache = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=2, start_percent=0.5))
    compile_(pipe, CompileOptions(precompile=False))
    assert pipe.transformer.forward.step_cache is cache
    generate(pipe, "flux")
    timesteps = (pipe.scheduler.timesteps / 1000).tolist()
    outside = [t > 0.5 for t in timesteps]
    assert any(outside) and not all(outside)
    assert [d for d, out in zip(cache.stats.decisions, outside) if out] == [True] * sum(outside)
    assert cache.stats.shallow_steps > 0


def test_adaptive_step_cache_at_threshold_0_is_the_eager_transformer():
    pipe = tiny_flux_pipeline()
    expected = generate(pipe, "flux")
    cache = deepcache_(pipe, DeepCacheConfig(mode="adaptive", threshold=0.0))
    assert torch.equal(generate(pipe, "flux"), expected)
    assert cache.stats.full_steps == STEPS and len(cache.changes) == STEPS - 1


def test_a_module_of_no_known_family_is_refused_and_changes_nothing():
    module = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="needs a diffusers UNet2DConditionModel or a DiT transformer of a known"):
        deepcache_(module, DeepCacheConfig())
    assert "forward" not in module.__dict__


def test_switching_to_another_checkpoints_folder_reuses_the_compiled_blocks(family, tmp_path):
    other = PIPELINES[family](seed=1)
    other.transformer.save_pretrained(tmp_path / "transformer")
    expected = generate(other, family)
    pipe = PIPELINES[family]()
    compile_(pipe, CompileOptions(precompile=False))
    first = generate(pipe, family)
    before = dynamo_graph_count()
    switch_weights_(pipe, tmp_path)
    assert relative_error(generate(pipe, family), expected) < COMPILE_RTOL
    assert dynamo_graph_count() == before and relative_error(first, expected) > 0.1


def test_switching_a_step_cached_transformer_ends_its_run_and_runs_the_new_weights(tmp_path):
    other = tiny_flux_pipeline(seed=1)
    other.transformer.save_pretrained(tmp_path / "transformer")
    deepcache_(other, DeepCacheConfig(mode="fixed", cache_interval=2))
    expected = generate(other, "flux")
    pipe = tiny_flux_pipeline()
    cache = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=2))
    generate(pipe, "flux")
    switch_weights_(pipe, tmp_path)
    assert cache.last_stats is not None and cache.stats.steps == 0  # the run ended at the switch
    assert relative_error(generate(pipe, "flux"), expected) < COMPILE_RTOL


def test_quantize_leaves_chromas_approximator_in_float_and_quantizes_the_blocks():
    """The family's float layers (Chroma's approximator: its error reaches every block) are left alone, with the reason
    in the report, as ComfyUI's QuantizeModel leaves them."""
    pipe = tiny_chroma_pipeline()
    report = quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0),
                       calibration={**dit_prompt("chroma"), "height": 32, "width": 32, "num_inference_steps": 2})
    approximator = [layer for layer in report.layers if layer.name.startswith("distilled_guidance_layer.")]
    assert approximator and all(not layer.quantized and "approximator" in layer.reason for layer in approximator)
    assert any(name.startswith("transformer_blocks.") for name in report.quantized)
    assert any(name.startswith("single_transformer_blocks.") for name in report.quantized)

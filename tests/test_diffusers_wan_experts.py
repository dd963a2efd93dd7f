"""Wan 2.2 A14B's layout in overdrive.api: a WanPipeline with two experts of one architecture, `transformer` for the
steps at t >= boundary_ratio * 1000 and `transformer_2` for the rest (tiny, fixed-seed, CPU). compile_, deepcache_,
quantize_, attention_ and switch_weights_ act on both; the experts share the compiled block graph, keep their own step
caches, calibrate in one run and switch together, all or nothing."""
import pytest
import torch

from diffusers_tiny import dit_prompt, tiny_flux_pipeline, tiny_wan_pipeline
from overdrive.api import (AttentionConfig, CompileOptions, DeepCacheConfig, QuantConfig, WeightMismatchError,
                           attention_, compile_, deepcache_, quantize_, switch_weights_)
from overdrive.core.blockwise import BlockwiseForward
from overdrive.compiler import dynamo_graph_count
from overdrive.diffusers_api.installed import installed_stack
from overdrive.quantization.modules import quantized_layers

STEPS = 6
BOUNDARY = 0.875  # Wan 2.2 T2V A14B's boundary_ratio: at 6 steps (shift 3) 2 high-noise steps, then 4 low-noise ones
EXPERTS = ("transformer", "transformer_2")
COMPILE_RTOL = 1e-4  # Inductor vs eager, float32 on the CPU
REUSED_RTOL = 0.065  # a reused call against the full transformer on the same input (as test_diffusers_dit)
INT8_RTOL = 0.05  # an int8 transformer call against float


def experts_pipeline(seed: int = 0):
    pipe = tiny_wan_pipeline(seed, experts=True)
    pipe.register_to_config(boundary_ratio=BOUNDARY)
    return pipe


def relative_error(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def generate(pipe, steps: int = STEPS):
    return pipe(**dit_prompt("wan"), height=32, width=32, num_inference_steps=steps, output_type="latent",
                generator=torch.Generator().manual_seed(1)).frames


def high_noise_steps(pipe) -> int:
    return int((pipe.scheduler.timesteps >= BOUNDARY * pipe.scheduler.config.num_train_timesteps).sum())


def recorded_calls(pipe) -> dict:
    """Each expert's calls in one generation, {name: [(args, kwargs, output)]}, through the forward it has."""
    calls, installed = {name: [] for name in EXPERTS}, {}
    for name in EXPERTS:
        module = getattr(pipe, name)
        installed[name] = module.__dict__.get("forward")

        def record(*args, _run=module.forward, _calls=calls[name], **kwargs):
            out = _run(*args, **kwargs)
            _calls.append((args, kwargs, out[0].clone()))
            return out
        module.forward = record
    try:
        with torch.no_grad():
            generate(pipe)
    finally:
        for name in EXPERTS:
            module = getattr(pipe, name)
            if installed[name] is None:
                del module.forward
            else:
                module.forward = installed[name]
    return calls


def weights(pipe) -> dict:
    return {name: {k: v.clone() for k, v in getattr(pipe, name).state_dict().items()} for name in EXPERTS}


def unchanged(pipe, before: dict) -> bool:
    return all(torch.equal(getattr(pipe, name).state_dict()[k], v) for name in EXPERTS for k, v in before[name].items())


def test_compile_runs_both_experts_through_one_block_graph_and_matches_eager():
    pipe = experts_pipeline()
    expected = generate(pipe)
    assert 0 < high_noise_steps(pipe) < STEPS
    before = dynamo_graph_count()
    compiled = compile_(pipe, CompileOptions(precompile=False))
    assert {"transformer.forward", "transformer_2.forward"} == set(compiled)  # Wan's video VAE stays eager
    assert all(isinstance(getattr(pipe, name).forward, BlockwiseForward) for name in EXPERTS)
    assert relative_error(generate(pipe), expected) < COMPILE_RTOL
    # One Wan block graph serves all six blocks of both experts (compiled here, or by an earlier test of the same
    # architecture in this process).
    graphs = {id(block.graph) for name in EXPERTS for block in getattr(pipe, name).forward.compiled.values()}
    assert len(graphs) == 1 and dynamo_graph_count() - before <= 1


def test_each_expert_keeps_its_own_step_cache_over_its_own_steps():
    pipe = experts_pipeline()
    caches = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=2))
    assert set(caches) == set(EXPERTS) and caches["transformer"] is not caches["transformer_2"]
    calls = recorded_calls(pipe)
    high = high_noise_steps(pipe)
    for name, steps in (("transformer", high), ("transformer_2", STEPS - high)):
        stats = caches[name].stats
        assert stats.decisions == [True, False] * (steps // 2) + [True] * (steps % 2), (name, stats.decisions)
        assert len(calls[name]) == 2 * steps  # cond and uncond: true CFG
        module = getattr(pipe, name)
        with torch.no_grad():
            errors = [relative_error(out, type(module).forward(module, *args, **kwargs)[0])
                      for args, kwargs, out in calls[name]]
        full = [e for i, e in enumerate(errors) if stats.decisions[i // 2]]
        reused = [e for i, e in enumerate(errors) if not stats.decisions[i // 2]]
        assert full == [0.0] * len(full), (name, errors)  # the expert's own weights on its full steps
        assert 0 < max(reused) < REUSED_RTOL, (name, errors)


def test_quantize_measures_both_experts_in_one_calibration_run():
    pipe = experts_pipeline()
    first = {name: calls[0] for name, calls in recorded_calls(pipe).items()}  # one eager call of each expert
    report = quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0),
                       calibration={**dit_prompt("wan"), "height": 32, "width": 32, "num_inference_steps": 4})
    assert report.calibrated
    reasons = {layer.name: layer.reason for layer in report.layers}
    for name in EXPERTS:  # diffusers' Wan reads its timestep dtype from these: quantized, they would have none
        assert "reads the float dtype" in reasons[f"{name}.condition_embedder.time_embedder.linear_1"]
    for name in EXPERTS:
        module = getattr(pipe, name)
        assert {f"{name}.{layer}" for layer in quantized_layers(module)} == \
            {layer for layer in report.quantized if layer.startswith(f"{name}.")} != set()
        args, kwargs, expected = first[name]
        with torch.no_grad():
            assert relative_error(module(*args, **kwargs)[0], expected) < INT8_RTOL


def test_attention_routes_both_experts():
    pipe = experts_pipeline()
    attention_(pipe, AttentionConfig(mode="auto"))
    assert all(installed_stack(getattr(pipe, name)).attention is not None for name in EXPERTS)


def test_switching_from_a_pipeline_folder_switches_both_experts_without_compiling(tmp_path):
    other = experts_pipeline(seed=1)
    other.transformer.save_pretrained(tmp_path / "transformer")
    other.transformer_2.save_pretrained(tmp_path / "transformer_2", max_shard_size="20KB")  # shards, as 14B experts
    assert (tmp_path / "transformer_2" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    expected = generate(other)
    pipe = experts_pipeline()
    compile_(pipe, CompileOptions(precompile=False))
    first = generate(pipe)
    before = dynamo_graph_count()
    switch_weights_(pipe, tmp_path)
    assert relative_error(generate(pipe), expected) < COMPILE_RTOL
    assert dynamo_graph_count() == before and relative_error(first, expected) > 0.1


def test_a_switch_that_does_not_fit_one_expert_changes_neither(tmp_path):
    other = experts_pipeline(seed=1)
    other.transformer.save_pretrained(tmp_path / "transformer")
    pipe = experts_pipeline()
    before = weights(pipe)
    with pytest.raises(FileNotFoundError, match="in transformer_2/"):
        switch_weights_(pipe, tmp_path)
    tiny_flux_pipeline().transformer.save_pretrained(tmp_path / "transformer_2")  # another architecture
    with pytest.raises(WeightMismatchError, match="not a checkpoint of this architecture"):
        switch_weights_(pipe, tmp_path)
    with pytest.raises(TypeError, match="two transformers"):
        switch_weights_(pipe, other.transformer.state_dict())
    assert unchanged(pipe, before)


def test_switching_quantized_experts_requantizes_each_from_its_own_new_weights(tmp_path):
    other = experts_pipeline(seed=1)
    for name in EXPERTS:
        getattr(other, name).save_pretrained(tmp_path / name)
    pipe = experts_pipeline()
    quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0),
              calibration={**dit_prompt("wan"), "height": 32, "width": 32, "num_inference_steps": 4})
    switch_weights_(pipe, tmp_path)
    for name in EXPERTS:
        layers, new = quantized_layers(getattr(pipe, name)), getattr(other, name).state_dict()
        assert layers
        for layer_name, layer in layers.items():
            weight = layer.weight_q.float() * layer.weight_scale.t()  # int8 rows times their scales
            assert relative_error(weight, new[f"{layer_name}.weight"]) < 0.01, (name, layer_name)


def test_a_lone_low_noise_expert_switches_from_its_own_folder(tmp_path):
    """A pipeline loaded with transformer=None runs transformer_2 alone: from a pipeline folder it reads
    transformer_2/, never the high-noise expert's transformer/ (same architecture: nothing else would tell)."""
    other = experts_pipeline(seed=1)
    for name in EXPERTS:
        getattr(other, name).save_pretrained(tmp_path / name)
    pipe = experts_pipeline()
    pipe.transformer = None
    switch_weights_(pipe, tmp_path)
    expected = other.transformer_2.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in pipe.transformer_2.state_dict().items())

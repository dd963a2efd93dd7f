"""The DeepCache node on ComfyUI's real ModelPatcher and sampler, in-process on the CPU, and its example workflow
through a real ComfyUI server.

Stated bound: on the tiny random-weight SD1.5 model (harness.inprocess.build_model), 10 euler steps at 64², interval 3
and depth 1 end SAMPLING_RTOL = 0.6 (relative L2) from the eager latent at most (measured 0.29). Random weights carry
far less step-to-step coherence in their deep features than a trained model, so this is loose; interval 1, and every
full step, are bit-identical to eager (torch.equal).
"""
import functools
import logging
from collections import Counter

import pytest
import torch

from overdrive.compiler import CompiledMethod, dynamo_graph_count
from overdrive.step_cache import DeepCacheConfigError, DeepCacheRunner
from overdrive.harness.inprocess import conditioning
from overdrive.harness.workflows import load_workflow, set_inputs
# Fixtures: the node classes, the tiny SD1.5 model (seed 0), and its eager latent (through this module's `sample`).
from test_nodes_inprocess import base, eager_latent, nodes  # noqa: F401
from test_server import latent_of, small, with_latent_output

RES, STEPS = 64, 10
SAMPLING_RTOL = 0.6
COMPILE_RTOL = 1e-3  # compiled (Inductor, float32 CPU) vs eager DeepCache latents
FORWARD = "diffusion_model.forward"
PLANNED_10 = "DeepCache: 10 steps, 4 full / 6 shallow, interval 3, depth 1 (planned)"


F, S = True, False  # a full and a shallow step in RunStats.decisions


def deepcache_lines(caplog) -> list:
    """DeepCache's plan and run summaries among the captured log records, in order."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("DeepCache: ")]


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def deepcache(model, interval=3, depth=1, start=0.0, end=1.0):
    from overdrive.nodes.deepcache_node import OverdriveDeepCache
    return OverdriveDeepCache.execute(model, interval, depth, start, end)[0]


def runner_of(model) -> DeepCacheRunner:
    runner = model.object_patches.get(FORWARD)
    assert isinstance(runner, DeepCacheRunner), f"no DeepCache patch on this model: {runner!r}"
    return runner


@pytest.fixture(scope="module")
def sample(comfy):
    import comfy.sample

    positive, negative = conditioning("sd15", RES, RES, seed=1)  # equal lengths: cond and uncond share one UNet call

    def run(model, steps=STEPS, res=RES):
        latent = torch.zeros(1, 4, res // 8, res // 8)
        noise = comfy.sample.prepare_noise(latent, 7)
        return comfy.sample.sample(model, noise, steps, 7.0, "euler", "normal", positive, negative, latent,
                                   seed=7, disable_pbar=True)
    return run


def test_node_is_registered_with_tooltips_and_a_description(nodes):
    node = nodes["OverdriveDeepCache"]
    assert node.GET_SCHEMA().display_name == "DeepCache (Overdrive)"
    assert node.DESCRIPTION and node.CATEGORY == "overdrive" and list(node.RETURN_TYPES) == ["MODEL"]
    spec = node.INPUT_TYPES()["required"]
    assert list(spec) == ["model", "cache_interval", "cache_depth", "start_percent", "end_percent"]
    assert all(options.get("tooltip") for _, options in spec.values())
    optional = node.INPUT_TYPES()["optional"]
    assert list(optional) == ["mode", "threshold"] and all(o.get("tooltip") for _, o in optional.values())
    assert (optional["mode"][1]["options"], optional["mode"][1]["default"]) == (
        ["auto", "fixed", "adaptive", "calibrated"], "auto")
    defaults = {name: options.get("default") for name, (_, options) in spec.items()}
    assert defaults == {"model": None, "cache_interval": 3, "cache_depth": 1, "start_percent": 0.0, "end_percent": 1.0}
    assert (spec["cache_interval"][1]["min"], spec["cache_interval"][1]["max"]) == (1, 10)


def test_interval_1_is_the_eager_latent_and_the_input_model_is_untouched(base, sample, eager_latent):
    patches_before = dict(base.object_patches)
    model = deepcache(base, interval=1)
    assert torch.equal(sample(model), eager_latent)
    stats = runner_of(model).stats
    assert (stats.steps, stats.full_calls, stats.shallow_calls, stats.fallback_calls) == (STEPS, STEPS, 0, 0)
    assert base.object_patches == patches_before and FORWARD not in base.object_patches
    assert torch.equal(sample(base.clone()), eager_latent)  # the input MODEL still samples eager
    # Loading the input MODEL unloaded the DeepCache clone and undid its object patch.
    assert not isinstance(base.model.diffusion_model.__dict__.get("forward"), DeepCacheRunner)


def test_interval_3_follows_the_schedule_within_the_stated_error_and_logs_each_run(base, sample, eager_latent, caplog):
    model = deepcache(base, interval=3)
    runner = runner_of(model)
    unet = base.model.diffusion_model
    ran = Counter()  # what really ran: the stem conv at every UNet call, the middle block only on full ones
    hooks = [unet.input_blocks[0][0].register_forward_hook(lambda *_: ran.update(["stem"])),
             unet.middle_block[0].register_forward_hook(lambda *_: ran.update(["deep"]))]
    try:
        with caplog.at_level(logging.INFO, logger="overdrive"):
            out = sample(model)
            stats = runner.stats
            # ComfyUI hands the UNet the run's whole sigma schedule: each run's plan is logged as it starts.
            assert deepcache_lines(caplog) == [PLANNED_10]
            again = sample(model)  # the next prompt on this model: a new run, which logs the schedule of the first
    finally:
        for hook in hooks:
            hook.remove()
    # Counted per step (one sigma), not per UNet call; here cond and uncond share each call.
    assert stats.decisions == [F, S, S] * 3 + [F]
    assert (stats.full_steps, stats.shallow_steps, stats.full_calls, stats.shallow_calls) == (4, 6, 4, 6)
    # Per prompt: 10 calls, the deep part at the 4 full steps; the first full step of each runner is also checked
    # once against the model's own forward (one more call of each).
    assert ran == Counter(stem=2 * STEPS + 1, deep=2 * 4 + 1)
    assert 0.0 < relative_error(out, eager_latent) <= SAMPLING_RTOL
    assert torch.equal(again, out)  # nothing of the first prompt's cache reached the second
    assert deepcache_lines(caplog) == [PLANNED_10] * 2
    with caplog.at_level(logging.INFO, logger="overdrive"):
        runner.reset()  # ends the second run (ComfyUI does not tell a model when sampling ends)
    assert deepcache_lines(caplog) == [PLANNED_10] * 2  # the runs went as planned: no end-of-run summary


def test_the_sampler_s_step_clock_decides_as_the_sigma_reads_do_without_reading_them(comfy, base, sample, caplog):
    """With a one-call-per-step sampler (euler) the runner takes each call's step from the sampler's callback: no
    per-call read of the sigma (the schedule is read once per run); decisions and latent are those of the reads. A
    sampler whose calls do not follow its schedule step by step (heun) keeps its calls read, and a clock that proves
    wrong is dropped with a warning."""
    import comfy.sample

    from overdrive.step_cache.clock import STEP_CLOCK, StepClock
    from overdrive.comfy_host import step_clock

    def reads_of(model, **run):
        runner, counted = runner_of(model), []
        original = runner._read
        runner._read = lambda info: counted.append(1) or original(info)
        out = sample(model, **run) if "sampler" not in run else sampler_run(model, run["sampler"])
        runner._read = original
        return out, len(counted), runner.last_stats or runner.stats

    positive, negative = conditioning("sd15", RES, RES, seed=1)

    def sampler_run(model, sampler_name):
        latent = torch.zeros(1, 4, RES // 8, RES // 8)
        return comfy.sample.sample(model, comfy.sample.prepare_noise(latent, 7), 6, 7.0, sampler_name, "normal",
                                   positive, negative, latent, seed=7, disable_pbar=True)

    clocked = deepcache(base, interval=3)
    out, reads, stats = reads_of(clocked)
    assert reads == 0 and stats.decisions == [F, S, S] * 3 + [F]
    unclocked = deepcache(base, interval=3)
    step_clock.remove(unclocked)
    reference, reads, reference_stats = reads_of(unclocked)
    assert reads == STEPS and torch.equal(out, reference) and reference_stats.decisions == stats.decisions

    _, reads, _ = reads_of(deepcache(base, interval=3), sampler="heun")
    assert reads > 0  # no clock for heun: every call is read

    # A clock the calls do not follow (here one that never moves on): the check sees it without waiting, the runner
    # warns once and reads every later call.
    wrong = deepcache(base, interval=3)
    step_clock.remove(wrong)
    runner = runner_of(wrong)
    stuck = StepClock(torch.linspace(14.6, 0.0, STEPS + 1))

    def with_stuck_clock(apply_model, call):
        call["c"]["transformer_options"][STEP_CLOCK] = stuck
        return apply_model(call["input"], call["timestep"], **call["c"])
    wrong.set_model_unet_function_wrapper(with_stuck_clock)
    with caplog.at_level(logging.WARNING, logger="overdrive.step_cache"):
        _, reads, _ = reads_of(wrong)
    assert 0 < reads < STEPS and "do not follow its sigma schedule" in caplog.text, caplog.text


def test_two_prompts_of_different_sizes_each_get_a_fresh_cache(base, sample):
    model = deepcache(base, interval=3)
    runner = runner_of(model)
    small_latent = sample(model, steps=4)
    large_latent = sample(model, steps=4, res=96)
    assert runner.schedule.runs == 2 and runner.last_stats.decisions == runner.stats.decisions == [F, S, S, F]
    assert all(t.shape[-1] == 96 // 8 for t in runner.cache._entries.values())
    # Equal to the same prompt on a DeepCache model that never saw the first size, and back again.
    assert torch.equal(large_latent, sample(deepcache(base, interval=3), steps=4, res=96))
    assert torch.equal(sample(model, steps=4), small_latent)


def test_bad_settings_are_refused_with_clear_errors(base):
    patches_before = dict(base.object_patches)
    with pytest.raises(DeepCacheConfigError, match=r"cache_depth=5 is out of range for this UNet: it has 4 skip "
                                                   r"branches .* so cache_depth must be in 1\.\.4"):
        deepcache(base, depth=5)
    with pytest.raises(DeepCacheConfigError, match=r"start_percent \(0.6\) must be < end_percent \(0.4\)"):
        deepcache(base, start=0.6, end=0.4)
    with pytest.raises(DeepCacheConfigError, match="cache_interval must be >= 1"):
        deepcache(base, interval=0)
    from overdrive.nodes.deepcache_node import OverdriveDeepCache
    with pytest.raises(DeepCacheConfigError, match="applies to DiT models .* takes mode='fixed'"):
        OverdriveDeepCache.execute(base, mode="adaptive")
    assert base.object_patches == patches_before
    assert runner_of(deepcache(base, depth=4)).paths.depth == 4  # every skip branch kept: only the middle is cached


def test_a_model_that_is_not_an_openaimodel_unet_passes_through_unchanged(comfy, caplog):
    """A real Stable Cascade stage B (ComfyUI's StageB, shrunk): not an openaimodel UNet."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    config = {"stable_cascade_stage": "b", "c_hidden": [32] * 4, "nhead": [-1, -1, 1, 1], "c_cond": 32, "c_r": 8,
              "c_clip": 16, "blocks": [[1] * 4] * 2, "block_repeat": [[1] * 4] * 2}
    model_config = comfy.supported_models.Stable_Cascade_B(config)
    model_config.set_inference_dtype(torch.float32, None)
    cascade = comfy.model_patcher.ModelPatcher(model_config.get_model({}, ""),
                                               load_device=comfy.model_management.get_torch_device(),
                                               offload_device=comfy.model_management.unet_offload_device())
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        out = deepcache(cascade)
    assert "StageB is not an openaimodel-style UNet" in caplog.text and "returned unchanged" in caplog.text
    assert out.model is cascade.model and out.object_patches == {} == cascade.object_patches


def test_a_forward_patch_deepcache_does_not_know_is_not_bypassed(base, caplog):
    unet = base.model.diffusion_model
    foreign = functools.partial(type(unet).forward, unet)  # another extension's replacement forward, say
    model = base.clone()
    model.add_object_patch(FORWARD, foreign)
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        out = deepcache(model)
    assert out.object_patches[FORWARD] is foreign and "DeepCache cannot wrap without bypassing it" in caplog.text


def with_weight_patch(model):
    """`model` cloned with real ComfyUI weight patches ("diff", as LoRA loaders add them): an outer and a deep layer."""
    out = model.clone()
    unet = model.model.diffusion_model
    generator = torch.Generator().manual_seed(3)
    for key, weight in (("input_blocks.0.0.weight", unet.input_blocks[0][0].weight),
                        ("middle_block.0.in_layers.2.weight", unet.middle_block[0].in_layers[2].weight)):
        out.add_patches({f"diffusion_model.{key}": (torch.randn(weight.shape, generator=generator) * 0.05,)}, 1.0)
    return out


def test_deepcache_before_lora_and_switch_weights_runs_the_new_weights(comfy, nodes, base, sample, builtin_checkpoints):
    import comfy.sd
    import folder_paths

    def run(model):
        return sample(model, steps=4)  # full, shallow, shallow, full

    # Interval 1: exactly the eager latent of the patched weights.
    exact = run(with_weight_patch(deepcache(base, interval=1)))
    assert torch.equal(exact, run(with_weight_patch(base)))
    assert relative_error(exact, run(base.clone())) > 1e-3  # the patch mattered
    # Interval 3: the same as DeepCache put after the patch; no feature of the unpatched weights is reused.
    cached = deepcache(base, interval=3)
    before = run(cached)  # the runner's cache now holds features of the unpatched weights
    assert torch.equal(run(with_weight_patch(cached)), run(deepcache(with_weight_patch(base), interval=3)))

    # SwitchWeights after DeepCache: the switched model gets a runner over its own new module.
    path = builtin_checkpoints["overdrive-builtin-sd15-seed1.safetensors"]
    folder_paths.add_model_folder_path("checkpoints", str(path.parent))
    switched = nodes["OverdriveSwitchWeights"].execute(cached, path.name)[0]
    runner = runner_of(switched)
    assert runner is not runner_of(cached) and runner.paths.unet is switched.model.diffusion_model
    assert runner.config == runner_of(cached).config
    loaded = comfy.sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]
    expected = run(deepcache(loaded, interval=3))
    out = run(switched)
    assert relative_error(out, expected) < 1e-6 and relative_error(out, before) > 1e-3
    assert runner.stats.decisions == [F, S, S, F]


def test_compile_and_deepcache_compose_in_both_orders_with_one_compile_per_path(nodes, base, sample):
    compile_model = nodes["OverdriveCompileModel"]
    steps = 4  # full, shallow, shallow, full: each path runs twice
    expected = sample(deepcache(base, interval=3), steps=steps)

    # Compile Model, then DeepCache: both paths compiled with the compile node's options.
    compiled = compile_model.execute(base, mode="default", cuda_graphs=True, dynamic="auto")[0]
    first = deepcache(compiled, interval=3)
    runner = runner_of(first)
    # Calls DeepCache cannot serve run the compiled forward, on Compile Model's graph.
    assert runner.native.graph is compiled.object_patches[FORWARD].graph
    assert isinstance(runner.full_path, CompiledMethod) and isinstance(runner.shallow_path, CompiledMethod)
    graphs = dynamo_graph_count()
    assert relative_error(sample(first, steps=steps), expected) < COMPILE_RTOL
    assert runner.stats.decisions == [F, S, S, F] and runner.stats.shallow_calls == 2
    assert dynamo_graph_count() - graphs == 2  # one graph per path, none per step
    assert runner.full_path.graph.graphs_compiled == runner.shallow_path.graph.graphs_compiled == 1
    sample(first, steps=steps)  # a second prompt: no recompile
    assert dynamo_graph_count() - graphs == 2
    # The sampler's step clock rides in transformer_options: both paths still run precompiled (guard-free) frames.
    for path in (runner.full_path, runner.shallow_path):
        assert path.graph.frames is not None and path.graph.frames.frames and path.graph.frames.failure is None

    # DeepCache, then Compile Model: the compile node gives its clone a copy of the runner with compiled paths.
    cached = deepcache(base, interval=3)
    second = compile_model.execute(cached, mode="default", cuda_graphs=True, dynamic="auto")[0]
    eager_runner, runner = runner_of(cached), runner_of(second)
    assert runner is not eager_runner and eager_runner.full_path == eager_runner.paths.full_forward
    assert isinstance(runner.native, CompiledMethod) and runner.native.module is base.model.diffusion_model
    assert runner.full_path.graph is runner_of(first).full_path.graph  # same architecture: the same graphs
    assert relative_error(sample(second, steps=steps), expected) < COMPILE_RTOL
    assert runner.stats.decisions == [F, S, S, F] and runner.stats.shallow_calls == 2
    assert dynamo_graph_count() - graphs == 2
    # DeepCache once more on that model: its runner is replaced (not nested), still compiled, on the same graphs.
    again = runner_of(deepcache(second, interval=2))
    assert again.native.graph is runner.native.graph and again.config.cache_interval == 2
    assert again.shallow_path.graph is runner.shallow_path.graph


def test_compile_deepcache_workflow_over_http(client, server):
    info = client.object_info()["OverdriveDeepCache"]
    assert info["display_name"] == "DeepCache (Overdrive)" and info["category"] == "overdrive" and info["description"]
    assert all(len(spec) > 1 and spec[1].get("tooltip") for spec in info["input"]["required"].values())

    workflow = small(load_workflow("compile_deepcache_sd15_api.json"))
    compiled = client.run(with_latent_output(workflow, "deepcache-compiled"))
    (image,) = client.output_files(compiled, server.output_dir)
    assert image.is_file() and image.stat().st_size > 0
    log = server.log_text()
    assert "Overdrive compiled OpenAIUNetPaths" in log and ".full_forward" in log and ".shallow_forward" in log

    # The same without Compile Model: the same latent (within compile tolerance).
    eager = load_workflow("compile_deepcache_sd15_api.json")
    eager["3"]["inputs"]["model"] = ["1", 0]
    del eager["2"]
    eager = small(eager)
    reference = client.run(with_latent_output(eager, "deepcache-eager"))
    assert relative_error(latent_of(compiled, server), latent_of(reference, server)) < COMPILE_RTOL

    # A second size on the same DeepCache model (ComfyUI reuses the node's output): a fresh cache; the new run logs
    # the schedule of the previous one.
    schedule = "DeepCache: 3 steps, 1 full / 2 shallow, interval 3, depth 1; 3 model calls: 1 full, 2 shallow"
    planned = "DeepCache: 3 steps, 1 full / 2 shallow, interval 3, depth 1 (planned)"
    runs = server.log_text().count(planned)  # each run's plan as it starts
    client.run(set_inputs(eager, "EmptyLatentImage", width=RES + 32, height=RES + 32))
    assert server.log_text().count(planned) == runs + 1 and schedule not in server.log_text()
    assert "ran full in shallow steps" not in server.log_text()

    from overdrive.harness.client import PromptFailed
    set_inputs(workflow, "OverdriveDeepCache", cache_depth=5)
    with pytest.raises(PromptFailed, match=r"cache_depth=5 is out of range for this UNet"):
        client.run(workflow)

"""Every Overdrive node on every DiT family of the CPU suite (Flux.1, Chroma, Qwen-Image, Wan 2.2, Z-Image, SD3.5,
LTX-Video, LTX-2; Flux.2's tiny file is tests/test_flux2_gpu.py's), on the built-in tiny diffusion-model files loaded by
ComfyUI's own loader (what Load Diffusion Model does) and sampled by its real sampler, on the CPU. Fidelity is checked
per model call: every call's output against eager's for the same input."""
import gc
import logging
import re
import weakref

import pytest
import torch

from overdrive.builtin_models.dit import (CPU_SUITE_FAMILIES, FAMILIES, conditioning, default_directory,
                                          diffusion_model_name, empty_latent, ensure_diffusion_model,
                                          flat_latent)
from overdrive.compiler import WeightMismatchError, dynamo_graph_count
from overdrive.families import family_of

RES = 64  # pixels: 8x8 latents (4x4 for Wan 2.2's 16x VAE) keep CPU compiles short
FRAMES = 5  # Wan: 2 latent frames
PER_CALL_TOLERANCE = 1e-4  # compiled vs eager, float32 on the CPU (measured 1e-6 to 5e-6)
QUANTIZED_TOLERANCE = 0.1  # int8 vs float per model call (tiny random models; measured in the test's log)
STEPS, CFG = 2, 3.0
# The compositions (LoRA, switching, the step cache on the compiled or quantized model, fp8 MLPs) exercise Overdrive's
# generic paths, not a family's code: they run on three families that between them cover every block layout (Flux:
# double and single streams; Wan 2.2: video with 3D RoPE and a feed-forward through comfy.ops; LTX-2: two streams of
# different widths crossing). Every family keeps the load, compile, restart, resolutions, step cache, quantization and
# switch-refusal tests, which run its own code.
COMPOSITION_FAMILIES = ("flux", "wan22", "ltx2")
# Chroma runs Flux's double and single blocks (its plug-in differs in how they get their modulation).
RUN_BY = {"chroma": "flux"}


@pytest.fixture(scope="module")
def composition(family):
    """First in a test's arguments: skips before the other module fixtures (a compile, a second file) are made."""
    if family not in COMPOSITION_FAMILIES:
        pytest.skip(f"a composition of generic paths: run on {', '.join(COMPOSITION_FAMILIES)}")


@pytest.fixture(scope="module")
def own_blocks(family):
    if family in RUN_BY:
        pytest.skip(f"{family} runs {RUN_BY[family]}'s blocks: {RUN_BY[family]}'s run of this test covers it")


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def nodes(comfy):
    from overdrive.nodes import NODES
    return NODES


@pytest.fixture(scope="module")
def models_folder(comfy):
    """The built-in files' folder (the test run's cache, where the server's fixtures put them: one copy on disk),
    searched by ComfyUI as Load Diffusion Model and Switch Diffusion Model list it."""
    import folder_paths

    folder = default_directory()
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    return folder


@pytest.fixture(scope="module", params=CPU_SUITE_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def first_file(family, models_folder):
    return ensure_diffusion_model(family, "tiny", 0, models_folder)


@pytest.fixture(scope="module")
def second_file(family, models_folder):
    """Seed 1 of the family: the same architecture, other weights. This module's alone: made when a test that runs
    asks for it, gone when the family's tests end (Z-Image's is 2 GB)."""
    path = models_folder / diffusion_model_name(family, "tiny", 1)
    made_here = not path.exists()
    yield ensure_diffusion_model(family, "tiny", 1, models_folder)
    if made_here:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def base(comfy, first_file):
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(first_file))


def record_calls(model):
    """A clone whose model calls are recorded: [(input, timestep, output)] per call, in order."""
    calls = []

    def wrapper(apply_model, args):
        out = apply_model(args["input"], args["timestep"], **args["c"])
        calls.append((args["input"].clone(), args["timestep"].clone(), out.detach().clone()))
        return out
    recorded = model.clone()
    recorded.set_model_unet_function_wrapper(wrapper)
    return recorded, calls


@pytest.fixture(scope="module")
def sample(comfy, family):
    return sampler(family)


def sampler(family):
    """run(model, res) -> (the sampled latent, the model calls recorded), on `family`'s fixed conditioning and
    noise."""
    import comfy.sample

    positive, negative = conditioning(family, 1), conditioning(family, 2)

    def run(model, res=RES):
        latent = empty_latent(family, res, res, FRAMES)
        noise = comfy.sample.prepare_noise(latent, 7)
        recorded, calls = record_calls(model)
        out = comfy.sample.sample(recorded, noise, STEPS, CFG, "euler", "simple", positive, negative, latent, seed=7,
                                  disable_pbar=True)
        return flat_latent(out), calls  # LTX-2's video and audio as one tensor
    return run


def assert_calls_match(calls, reference_calls, tolerance):
    assert len(calls) == len(reference_calls) > 0
    errors = [relative_error(out, ref) for (_, _, out), (_, _, ref) in zip(calls, reference_calls)]
    assert max(errors) < tolerance, errors
    return max(errors)


@pytest.fixture(scope="module")
def eager(base, sample):
    return sample(base.clone())


@pytest.fixture(scope="module")
def compiled(nodes, base):
    return nodes["OverdriveCompileModel"].execute(base)[0]


def test_the_builtin_file_loads_as_its_family(base, family):
    assert type(base.model.model_config).__name__ == FAMILIES[family].model_class


def distinct_blocks(model) -> int:
    """How many distinct block graphs Compile Model's blockwise forward compiles for this model."""
    from overdrive.core.blockwise import BlockwiseForward
    forward = model.object_patches["diffusion_model.forward"]
    assert isinstance(forward, BlockwiseForward) and forward.compiled
    return len({c.fingerprint for c in forward.compiled.values()})


def test_an_image_familys_latent_is_the_one_comfyui_samples(comfy, base, family):
    """An image family's latent has ComfyUI's shape for an empty image (Qwen-Image's Wan-VAE latent gains a time
    axis of one frame, not a video's frames): the bench once ran Qwen-Image as a 9-frame video."""
    import comfy.sample

    latent = FAMILIES[family].latent
    if latent.get("video"):
        pytest.skip("a video family's frames are the caller's choice")
    empty_image = torch.zeros(1, latent["channels"], RES // latent["spatial"], RES // latent["spatial"])
    expected = comfy.sample.fix_empty_latent_channels(base, empty_image).shape
    assert empty_latent(family, RES, RES, FRAMES).shape == expected


def test_compile_model_compiles_each_distinct_block_once_and_matches_eager_per_call(compiled, sample, eager, family,
                                                                                   per_call_tolerance):
    graphs = dynamo_graph_count()
    out, calls = sample(compiled)
    # One graph per distinct block (Flux: a double and a single block; none if another test compiled them already), and
    # one more where a block's input arrives in another memory layout (Wan's first block, after the patch embedding's
    # transpose: stride 256 where the others see 1).
    assert dynamo_graph_count() - graphs <= 2 * distinct_blocks(compiled) <= 6
    assert_calls_match(calls, eager[1], per_call_tolerance)
    assert torch.isfinite(out).all()
    graphs = dynamo_graph_count()
    sample(compiled)
    assert dynamo_graph_count() == graphs  # warm: no recompile for the same shape


def test_a_restart_runs_every_block_from_its_saved_frame_without_tracing(nodes, base, compiled, sample, eager,
                                                                       caplog):
    """Precompile (the default): every block call shape is saved whole beside the compile cache, so a process that
    starts again (here: no shared graph and no frame in memory) runs every block from its frame without Dynamo
    tracing anything, and matches eager per call."""
    from overdrive.compiler import clear_shared_graphs

    sample(compiled)  # the frames of every block shape are built and saved
    clear_shared_graphs()
    restarted = nodes["OverdriveCompileModel"].execute(base)[0]
    graphs = dynamo_graph_count()
    with caplog.at_level(logging.INFO, logger="overdrive.compiler"):
        out, calls = sample(restarted)
    assert dynamo_graph_count() == graphs, caplog.text[-3000:]
    assert caplog.text.count("loaded the precompiled frame") >= distinct_blocks(restarted)
    assert_calls_match(calls, eager[1], PER_CALL_TOLERANCE)


def test_lora_on_the_compiled_model_applies_without_recompiling(composition, base, compiled, sample):
    sample(compiled)
    graphs = dynamo_graph_count()
    # A weight patch as LoRA loaders add it ("diff"), on the model's first linear layer.
    key, weight = next((f"diffusion_model.{k}", v) for k, v in base.model.diffusion_model.named_parameters()
                       if k.endswith(".weight") and v.ndim == 2)
    diff = torch.randn(weight.shape, generator=torch.Generator().manual_seed(3)) * 0.05 * weight.std()
    with_lora, eager_lora = compiled.clone(), base.clone()
    for m in (with_lora, eager_lora):
        m.add_patches({key: (diff,)}, 1.0)
    (out, calls), (_, expected_calls) = sample(with_lora), sample(eager_lora)
    assert_calls_match(calls, expected_calls, PER_CALL_TOLERANCE)
    assert relative_error(out, sample(compiled)[0]) > 1e-5  # the patch changed the result
    assert dynamo_graph_count() == graphs


def test_a_second_and_third_resolution_compile_one_shape_generic_graph(own_blocks, compiled, base, sample, family):
    """dynamic=auto (documented): the first shape is specialised, a second compiles one shape-generic graph per
    distinct block that serves every later size, each right (the blocks are shape-generic; the model's own position
    and padding code around them runs eager)."""
    sample(compiled)
    graphs = dynamo_graph_count()
    out, calls = sample(compiled, res=2 * RES)
    # One generic graph per distinct block, and one more where calls pass different optional arguments (Qwen-Image's
    # generic graph, traced on a call with a tensor where the next passes None).
    assert dynamo_graph_count() - graphs <= 2 * distinct_blocks(compiled)
    assert_calls_match(calls, sample(base.clone(), res=2 * RES)[1], PER_CALL_TOLERANCE)
    graphs = dynamo_graph_count()
    out, calls = sample(compiled, res=3 * RES // 2)
    assert dynamo_graph_count() == graphs
    assert_calls_match(calls, sample(base.clone(), res=3 * RES // 2)[1], PER_CALL_TOLERANCE)


@pytest.fixture(scope="module")
def per_call_tolerance():
    return PER_CALL_TOLERANCE  # tests shared with tests/test_flux2_gpu.py, which runs them in bf16


def test_switch_diffusion_model_swaps_in_another_file_of_the_family_without_recompiling(composition, comfy, nodes,
                                                                                      compiled, second_file, sample,
                                                                                      per_call_tolerance):
    import comfy.sd

    sample(compiled)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(compiled, unet_name=second_file.name)[0]
    out, calls = sample(switched)
    assert dynamo_graph_count() == graphs
    _, expected = sample(comfy.sd.load_diffusion_model(str(second_file)))
    assert_calls_match(calls, expected, per_call_tolerance)
    assert relative_error(out, sample(compiled)[0]) > 1e-3  # other weights, another result


def test_switching_to_another_familys_file_is_refused_and_the_model_is_untouched(nodes, compiled, family,
                                                                                models_folder, sample, eager):
    other = "wan22" if family != "wan22" else "sd35"  # both tiny, quick to write
    path = ensure_diffusion_model(other, "tiny", 0, models_folder)
    with pytest.raises(WeightMismatchError, match="left unchanged"):
        nodes["OverdriveSwitchDiffusionModel"].execute(compiled, unet_name=path.name)
    assert_calls_match(sample(compiled)[1], eager[1], PER_CALL_TOLERANCE)


def test_step_cache_reuses_the_later_blocks_on_cached_steps_and_is_exact_on_full_steps(nodes, base, sample, eager,
                                                                                       caplog):
    with caplog.at_level(logging.INFO, logger="overdrive"):
        cached = nodes["OverdriveDeepCache"].execute(base, mode="fixed", cache_interval=2)[0]
        out, calls = sample(cached)  # step 0 full, step 1 reused
        again, calls_again = sample(cached)
    assert_calls_match(calls[:1], eager[1][:1], 1e-6)
    reused = relative_error(calls[1][2], eager[1][1][2])
    assert 1e-4 < reused < 0.5, reused  # an approximation of the full step, not the full step
    logging.getLogger("overdrive").info("step cache, reused step's relative error %.4f", reused)
    assert "1 full / 1 shallow" in caplog.text
    assert torch.equal(out, again)  # the second run reused nothing of the first


def test_step_cache_on_the_compiled_model_compiles_no_more_and_matches_it_eager(composition, nodes, base, compiled,
                                                                                sample, per_call_tolerance):
    eager_cached = nodes["OverdriveDeepCache"].execute(base, mode="fixed", cache_interval=2)[0]
    after = nodes["OverdriveDeepCache"].execute(compiled, mode="fixed", cache_interval=2)[0]
    before = nodes["OverdriveCompileModel"].execute(eager_cached)[0]
    sample(compiled)
    graphs = dynamo_graph_count()
    _, expected = sample(eager_cached)
    for model in (after, before):
        assert_calls_match(sample(model)[1], expected, per_call_tolerance)
    assert dynamo_graph_count() == graphs  # full and reused steps run the blocks compiled for the model


def test_adaptive_step_cache_at_threshold_0_runs_every_step_in_full(nodes, base, sample, eager):
    cached = nodes["OverdriveDeepCache"].execute(base, mode="adaptive", threshold=0.0)[0]
    assert_calls_match(sample(cached)[1], eager[1], 1e-6)


def step_cache_of(model):
    return model.object_patches["diffusion_model.forward"].step_cache


def test_calibrated_decisions_carry_over_a_lora_change_and_a_switched_file_is_measured_again(composition, nodes, base,
                                                                                            sample, second_file):
    """A LoRA or strength change runs the node chain again, which builds a new forward over the same model: its step
    cache replays what the first run measured (nothing measured, no wait on the device). Another file's weights are
    measured again."""
    cache = nodes["OverdriveDeepCache"]
    first = cache.execute(base, mode="calibrated", threshold=1e9)[0]
    sample(first)
    assert step_cache_of(first).changes  # measured
    key, weight = next((f"diffusion_model.{k}", v) for k, v in base.model.diffusion_model.named_parameters()
                       if k.endswith(".weight") and v.ndim == 2)
    with_lora = base.clone()
    with_lora.add_patches({key: (torch.full_like(weight, 1e-3),)}, 0.5)
    again = cache.execute(with_lora, mode="calibrated", threshold=1e9)[0]
    sample(again)
    assert step_cache_of(again) is not step_cache_of(first) and step_cache_of(again).changes == []
    assert step_cache_of(again).stats.decisions == step_cache_of(first).stats.decisions
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(first, unet_name=second_file.name)[0]
    sample(switched)
    assert step_cache_of(switched).changes


def quantize_every_layer(nodes, model, family, fmt="int8", **settings):
    """QuantizeModel with no density or speed rule (every layer whose error passes is quantized), calibrated for one
    step on the family's built-in conditioning and latent: (its report, None where it fell back, and the quantized
    model)."""
    from overdrive.comfy_host.quantized_model import quantization_report
    from overdrive.quantization import formats

    quantized = nodes["OverdriveQuantizeModel"].execute(model, format=fmt, bits=formats.get(fmt).bits,
                                                        compute_density_threshold=0.0, min_speedup=0.0,
                                                        calibration_steps=1,
                                                        positive=conditioning(family, 1),
                                                        negative=conditioning(family, 2),
                                                        latent={"samples": empty_latent(family, RES, RES, FRAMES)},
                                                        **settings)[0]
    return quantization_report(quantized), quantized


def test_quantize_model_decides_per_layer_and_reuses_its_decisions(own_blocks, nodes, base, family, sample, eager,
                                                                   caplog):
    with caplog.at_level(logging.INFO, logger="overdrive"):
        report, quantized = quantize_every_layer(nodes, base, family)
    assert report is not None, caplog.text  # None: quantizing failed and fell back
    assert not report.cache_hit and report.quantized, report.summary()
    # The family's float layers (Chroma's approximator, LTX-Video's text-only projections) stay float, saying why.
    float_layers = dict(family_of(base.model.diffusion_model).float_layers)
    kept = [layer for layer in report.layers if any(re.match(pattern, layer.name) for pattern in float_layers)]
    assert bool(kept) == bool(float_layers)
    assert all(not layer.quantized and layer.reason in float_layers.values() for layer in kept), kept
    quantized_calls = sample(quantized)[1]
    error = assert_calls_match(quantized_calls, eager[1], QUANTIZED_TOLERANCE)
    logging.getLogger("overdrive").info("%s: %d layers int8, per-call error %.4f", family, len(report.quantized), error)

    again, _ = quantize_every_layer(nodes, base, family)
    assert again is report  # the same layers, reused: no calibration, no quantizing

    if family not in COMPOSITION_FAMILIES:
        return
    # The step cache over the quantized model: its full step is the quantized model's, and the next step is reused
    # (QuantizeModel's own entry in transformer_options is not a block patch that would stop the cache).
    with caplog.at_level(logging.INFO, logger="overdrive"):
        cached = nodes["OverdriveDeepCache"].execute(quantized, mode="fixed", cache_interval=2)[0]
        calls = sample(cached)[1]
        sample(cached)  # the first run's counts are logged when the next starts
    assert_calls_match(calls[:1], quantized_calls[:1], 1e-6)
    assert "1 full / 1 shallow" in caplog.text and "ran full in shallow steps" not in caplog.text


GELU_MLP_FAMILIES = {"flux", "chroma", "qwen_image", "wan22", "sd35", "ltxv", "ltx2"}  # fc1 -> tanh-GELU -> fc2


def test_fp8_mlps_run_fc1_gelu_and_fc2s_cast_fused_and_match_the_layers_run_apart(composition, nodes, base, family,
                                                                                 second_file, sample):
    """Quantize Model in fp8: each MLP whose two projections are static fp8 layers runs fc1, tanh-GELU and fc2's
    input cast as one op (cuBLASLt's epilogue on the GPU; here torch's fp8 GEMM and GELU in float32), its activation
    module passing the e4m3 result through. Per model call it matches the same 8-bit layers run apart, and compiled
    it matches itself eager (the first call, on the same input, within 1 %; the next one's input is each run's own
    step, and a flipped e4m3 rounding moves it further)."""
    from overdrive.comfy_host.quantized_state import quantized_modules
    from overdrive.quantization import fp8_supported
    from overdrive.quantization.gelu_fusion import gelu_mlps
    mlps = gelu_mlps(base.model.diffusion_model)
    if family not in GELU_MLP_FAMILIES:  # Z-Image's gated SiLU MLPs: nothing to fuse or to run
        assert not mlps, mlps
        return
    if not fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm has no CPU fp8 kernel in this build")
    _, quantized = quantize_every_layer(nodes, base, family, fmt="fp8_e4m3")
    layers = quantized_modules(quantized)
    classes = {key: cls for key, cls in quantized.object_patches.items() if key.endswith(".__class__")}
    activations = [key for key, cls in classes.items() if not hasattr(cls, "overdrive_sequence")]
    # ComfyUI 0.33's Wan and LTX feed-forwards apply GELU inside comfy.ops.linear_input_act, bypassing the activation
    # module: each such holder runs its layers in order instead.
    holders = sorted(key for key, cls in classes.items() if hasattr(cls, "overdrive_sequence"))
    linked = [layer for layer in layers.values() if getattr(layer, "gelu_dtype", None)]
    # Every MLP whose two layers became fp8 (tiny LTX-2's audio layers, of a width no fp8 GEMM takes, stay float).
    expected = [mlp for mlp in mlps if all(getattr(layers.get(name), "format", "") == "fp8_e4m3"
                                           for name in (mlp.fc1, mlp.fc2))]
    assert len(linked) == len(activations) == len(expected) > 0, (activations, mlps)
    assert holders == sorted(f"diffusion_model.{mlp.holder}.__class__" for mlp in expected if mlp.holder)
    assert bool(holders) == (family in {"wan22", "ltxv", "ltx2"}), holders
    fused = sample(quantized)[1]
    dtypes = [layer.gelu_dtype for layer in linked]
    for layer in linked:  # the same layers, each GEMM on its own (the GELU modules then apply GELU themselves)
        layer.gelu_dtype = None
    try:
        apart = sample(quantized)[1]
    finally:
        for layer, dtype in zip(linked, dtypes):
            layer.gelu_dtype = dtype
    error = assert_calls_match(fused, apart, 1e-2)
    before = dynamo_graph_count()
    compiled_calls = sample(nodes["OverdriveCompileModel"].execute(quantized)[0])[1]
    compiled_error = assert_calls_match(compiled_calls[:1], fused[:1], 1e-2)
    assert_calls_match(compiled_calls, fused, QUANTIZED_TOLERANCE)
    # Loaded, the tree carries the activations' swapped classes (ComfyUI leaves them after a run, and Switch Diffusion
    # Model copies the tree so): the same MLPs are found in it, and switching links the re-quantized layers again with
    # each activation given the class it had, not a subclass of it.
    import comfy.model_management
    comfy.model_management.load_models_gpu([quantized])
    assert any(type(module).__name__.endswith("UnlessFused") for module in base.model.diffusion_model.modules())
    assert gelu_mlps(base.model.diffusion_model) == mlps
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(quantized, unet_name=second_file.name)[0]
    relinked = [layer for layer in quantized_modules(switched).values() if getattr(layer, "gelu_dtype", None)]
    assert len(relinked) == len(linked) and not set(map(id, relinked)) & set(map(id, linked))
    assert all(cls.__name__.count("UnlessFused") + cls.__name__.count("InOrder") == 1
               for key, cls in switched.object_patches.items() if key.endswith(".__class__"))
    assert torch.isfinite(sample(switched)[0]).all()
    logging.getLogger("overdrive").info("%s: %d fused MLPs; per call %.2e against the layers apart, compiled %.2e "
                                        "against eager, %d graphs", family, len(linked), error, compiled_error,
                                        dynamo_graph_count() - before)


def test_two_experts_share_graphs_and_each_step_cache_starts_its_own_run(comfy, nodes, family, compiled, sample,
                                                                        request):
    """Wan 2.2 A14B's workflow: a high-noise and a low-noise model of one architecture, each through Compile Model and
    DeepCache, sampled by two KSamplerAdvanced over the two parts of one schedule. The second expert compiles
    nothing, and its first step is a full step of its own weights: nothing of the first expert's cache is reused."""
    import comfy.sample
    import comfy.sd

    if family != "wan22":
        pytest.skip("two experts of one schedule: Wan 2.2 A14B's layout")
    steps, split = 4, 1
    low_base = comfy.sd.load_diffusion_model(str(request.getfixturevalue("second_file")))
    positive, negative = conditioning(family, 1), conditioning(family, 2)
    latent = empty_latent(family, RES, RES, FRAMES)
    noise = comfy.sample.prepare_noise(latent, 7)

    def two_experts(high, low):
        (high, high_calls), (low, low_calls) = record_calls(high), record_calls(low)
        part = comfy.sample.sample(high, noise, steps, CFG, "euler", "simple", positive, negative, latent,
                                   last_step=split, seed=7, disable_pbar=True)  # leftover noise returned
        comfy.sample.sample(low, torch.zeros_like(noise), steps, CFG, "euler", "simple", positive, negative, part,
                            disable_noise=True, start_step=split, seed=7, disable_pbar=True)
        return high_calls, low_calls

    plain_high, plain_low = two_experts(compiled.clone(), low_base.clone())  # without the step cache
    sample(compiled)
    low_compiled = nodes["OverdriveCompileModel"].execute(low_base)[0]
    cache = nodes["OverdriveDeepCache"]
    graphs = dynamo_graph_count()
    high_calls, low_calls = two_experts(cache.execute(compiled, mode="fixed", cache_interval=2)[0],
                                        cache.execute(low_compiled, mode="fixed", cache_interval=2)[0])
    assert dynamo_graph_count() == graphs  # the second expert runs the first's block graphs
    assert len(high_calls) == split and len(low_calls) == steps - split
    assert_calls_match(high_calls, plain_high, PER_CALL_TOLERANCE)
    assert_calls_match(low_calls[:1], plain_low[:1], PER_CALL_TOLERANCE)  # a full step: the low expert's own
    assert relative_error(low_calls[1][2], plain_low[1][2]) > PER_CALL_TOLERANCE  # then a reused one


@pytest.mark.parametrize("after", ["unloaded", "dropped-while-loaded", "an-eager-clone-ran-then-unloaded"])
def test_a_model_every_node_ran_on_is_freed_once_comfyui_lets_go_of_it_without_the_cycle_collector(
        composition, comfy, nodes, family, first_file, sample, after):
    """A user's next file replaces this one in ComfyUI's cache: its weights must go then, not at Python's next cycle
    collection (a 12 B model's host copy stayed beside the next one's). Quantize, Compile, the step cache and a clone
    after them (a LoRA loader's), sampled, then unloaded as a load of another file does, dropped still loaded
    (ComfyUI leaves a run's object patches applied), or unloaded after an eager clone of the same file ran (its
    unpatch puts the module's own forward back)."""
    if family != "flux":
        pytest.skip("the same nodes on every family: run on one")
    import comfy.model_management
    import comfy.sd
    gc.collect()
    gc.disable()
    try:
        model = comfy.sd.load_diffusion_model(str(first_file))
        quantized = quantize_every_layer(nodes, model, family)[1]
        compiled = nodes["OverdriveCompileModel"].execute(quantized)[0]
        cached = nodes["OverdriveDeepCache"].execute(compiled.clone(), mode="fixed", cache_interval=2)[0]
        sample(cached)
        if after == "an-eager-clone-ran-then-unloaded":
            sample(model.clone())
        if after != "dropped-while-loaded":
            comfy.model_management.unload_all_models()
        module, patcher = weakref.ref(model.model.diffusion_model), weakref.ref(model)
        del model, quantized, compiled, cached
        assert patcher() is None and module() is None, [type(r).__name__ for r in gc.get_referrers(module())]
    finally:
        gc.enable()


def test_the_last_clone_running_quantized_layers_sends_them_home_when_it_goes(composition, comfy, nodes, family,
                                                                              first_file, monkeypatch):
    """The quantized set outlives its clones (it lives as long as the file's model); a clone ComfyUI drops while loaded
    must not leave the set's layers on the GPU out of ComfyUI's sight: when the last clone running them goes, the
    layers on the GPU go home as an unload sends them. The CPU has no GPU to leave them on: the layers report "cuda"
    here, and the move home is recorded."""
    if family != "flux":
        pytest.skip("the same nodes on every family: run on one")
    import comfy.sd
    from overdrive.comfy_host import quantized_follower
    sent = []
    monkeypatch.setattr(quantized_follower, "on_device", lambda layer: torch.device("cuda"))
    monkeypatch.setattr(quantized_follower, "send_home", lambda quantized, layers, device: sent.append(len(layers)))
    model = comfy.sd.load_diffusion_model(str(first_file))
    quantized = quantize_every_layer(nodes, model, family)[1]
    again = quantize_every_layer(nodes, model.clone(), family)[1]  # another run over the same set (a LoRA change)
    lora = quantized.clone()
    gc.collect()
    del quantized
    gc.collect()
    assert not sent  # its clone, and the other run, still run the layers
    del lora
    gc.collect()
    assert not sent
    layers = len(quantized_follower.followers(again)[0].quantized.layers)
    del again
    gc.collect()
    assert sent == [layers]


def test_a_stop_mid_sampling_leaves_the_step_cache_to_start_the_next_prompt_afresh(comfy, nodes, base, family):
    """A stop (ComfyUI raises it from the step callback) after a reused step is not a failure: the next prompt's
    result is exactly that of a step-cached run that was never stopped."""
    import comfy.sample
    from comfy.model_management import InterruptProcessingException

    if family != "flux":
        pytest.skip("the step cache is the same for every family")
    cached = nodes["OverdriveDeepCache"].execute(base, mode="fixed", cache_interval=2)[0]
    positive, negative = conditioning(family, 1), conditioning(family, 2)
    latent = empty_latent(family, RES, RES, FRAMES)

    def run(callback=None):
        return comfy.sample.sample(cached, comfy.sample.prepare_noise(latent, 7), 4, CFG, "euler", "simple", positive,
                                   negative, latent, seed=7, disable_pbar=True, callback=callback)

    expected = run()

    def stop_after_the_reused_step(step, *_):
        if step == 1:
            raise InterruptProcessingException()
    with pytest.raises(InterruptProcessingException):
        run(stop_after_the_reused_step)
    assert torch.equal(run(), expected)


def test_a_model_loaded_with_fp8_weights_compiles_caches_switches_and_quantizes(comfy, nodes, family, first_file,
                                                                                sample, request):
    """Load Diffusion Model's `weight_dtype` fp8_e4m3fn (how Flux is commonly run; here on SD3.5: weights stored in 8
    bits, each layer cast to the compute dtype as it runs): Compile Model and the step cache match that model eager per
    call; Switch Diffusion Model puts a bf16 file's weights in at the running model's fp8, as loading that file with fp8
    weights does; QuantizeModel quantizes from the fp8 weights."""
    import comfy.sd

    if family != "sd35":  # the smallest tiny file (Flux's, a width detection fixes, took 48 s here)
        pytest.skip("ComfyUI's fp8 weight storage is the same for every family")

    def load_fp8(path):
        return comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn})
    fp8, second_file = load_fp8(first_file), request.getfixturevalue("second_file")
    assert {t.dtype for t in fp8.model.diffusion_model.state_dict().values()} == {torch.float8_e4m3fn}
    _, eager_calls = sample(fp8.clone())
    compiled = nodes["OverdriveCompileModel"].execute(fp8)[0]
    assert_calls_match(sample(compiled)[1], eager_calls, PER_CALL_TOLERANCE)
    cached = nodes["OverdriveDeepCache"].execute(compiled, mode="fixed", cache_interval=2)[0]
    assert_calls_match(sample(cached)[1][:1], eager_calls[:1], PER_CALL_TOLERANCE)
    graphs = dynamo_graph_count()
    switched = nodes["OverdriveSwitchDiffusionModel"].execute(compiled, unet_name=second_file.name)[0]
    assert {t.dtype for t in switched.model.diffusion_model.state_dict().values()} == {torch.float8_e4m3fn}
    assert_calls_match(sample(switched)[1], sample(load_fp8(second_file))[1], PER_CALL_TOLERANCE)
    assert dynamo_graph_count() == graphs
    report, quantized = quantize_every_layer(nodes, fp8, family)
    assert report is not None and report.quantized
    assert_calls_match(sample(quantized)[1], eager_calls, QUANTIZED_TOLERANCE)


def test_host_sync_fixes_replace_comfyuis_functions_and_sample_the_same(nodes, base, sample, family):
    """Overdrive's forward for a model puts its family's host-sync fixes in place of ComfyUI's functions (Wan's time
    embedding, LTX-Video's token coordinates: each copies a tensor from the CPU at every model call, which waits for
    the GPU, tests/test_host_syncs_gpu.py), and a whole sampled run gives ComfyUI's result bit for bit."""
    from overdrive.families import _ORIGINALS, family_of

    fixes = family_of(base.model.diffusion_model).host_sync_fixes
    if not fixes:
        pytest.skip("no host-sync fix in this family")
    for fix in fixes:
        fix.uninstall()
    comfys = {fix.name: fix.current() for fix in fixes}
    before, _ = sample(base.clone())
    cached = nodes["OverdriveDeepCache"].execute(base, mode="fixed", cache_interval=1)[0]  # builds Overdrive's forward
    for fix in fixes:
        assert fix.current() is fix.replacement and _ORIGINALS[fix.module, fix.name] is comfys[fix.name]
    after, _ = sample(cached)
    assert torch.equal(after, before)


def test_wans_time_embedding_equals_comfyuis(comfy, family):
    import comfy.ldm.wan.model as comfy_wan

    from overdrive.families import wan

    if family != "wan22":
        pytest.skip("a Wan fix")
    comfys = next(fix for fix in wan.FAMILY.host_sync_fixes if fix.module == comfy_wan.__name__).original()
    for dim in (256, 64):
        for position in (torch.rand(2 * 3510) * 1000, torch.arange(0, 1000, 37), torch.tensor([999.0, 0.5])):
            assert torch.equal(wan.time_embedding(dim, position), comfys(dim, position))


def test_ltx_videos_token_coordinates_equal_comfyuis(comfy, family):
    """Both fixes against ComfyUI's functions at the layouts LTX-Video runs (start and end of each patch; a causal
    first frame) and others: same values, same dtype."""
    from comfy.ldm.lightricks import symmetric_patchifier

    from overdrive.families import ltxv

    if family != "ltxv":
        pytest.skip("an LTX-Video fix")
    comfys_coords, comfys_pixels = (fix.original() for fix in ltxv.FAMILY.host_sync_fixes)
    assert comfys_pixels is symmetric_patchifier.latent_to_pixel_coords
    for patch in ((1, 1, 1), (1, 2, 2)):
        for start_end in (True, False):
            patchifier = symmetric_patchifier.SymmetricPatchifier(patch[1], start_end=start_end)
            for frames, height, width, batch in ((13, 16, 24, 2), (1, 2, 2, 1), (5, 4, 6, 3)):
                args = (frames, height, width, batch, "cpu")
                expected, got = comfys_coords(patchifier, *args), ltxv.latent_coords(patchifier, *args)
                assert got.dtype == expected.dtype and torch.equal(got, expected)
                for latent in (expected, expected.float()):
                    for factors in ((8, 32, 32), (1, 16, 16), (8.0, 32, 32)):
                        for causal in (True, False):
                            want = comfys_pixels(latent.clone(), factors, causal)
                            have = ltxv.pixel_coords(latent.clone(), factors, causal)
                            assert have.dtype == want.dtype and torch.equal(have, want)

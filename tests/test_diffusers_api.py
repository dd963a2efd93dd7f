"""overdrive.api on real diffusers pipelines (CPU): compile_, quantize_, deepcache_, switch_weights_.

Tiny StableDiffusionPipeline (UNet2DConditionModel 32/64 channels, AutoencoderKL, CLIPTextModel, DDIM) with fixed-seed
random weights; every output is compared with the eager pipeline at the same seed. One test compiles (UNet + VAE
decode, two Inductor graphs); the others run eager.
"""
import logging

import numpy as np
import pytest
import torch

from diffusers_tiny import tiny_sd_pipeline, tiny_unet
from overdrive.api import (CompileOptions, DeepCacheConfig, QuantConfig, WeightMismatchError, compile_, deepcache_,
                           quantize_, switch_weights_)
from overdrive.compiler import clear_shared_graphs, dynamo_graph_count
from overdrive.step_cache import DeepCacheConfigError, DeepCacheRunner, UnsupportedUNetError

STEPS = 10
COMPILE_RTOL = 1e-4     # Inductor vs eager, float32 on the CPU (measured ~1e-6)
INT8_RTOL = 0.05        # int8 W8A8 UNet vs float, final latent after 10 steps (measured ~0.014)
DEEPCACHE_RTOL = 0.2    # interval 3, depth 1, final latent after 10 steps (measured ~0.09)
CALIBRATION = {"prompt": "a red cat", "height": 16, "width": 16}


def relative_error(a, b) -> float:
    a, b = (torch.as_tensor(np.asarray(v)).double() for v in (a, b))
    return ((a - b).norm() / b.norm()).item()


def generate(pipe, output_type="latent", steps=STEPS):
    return pipe("a red cat", num_inference_steps=steps, guidance_scale=7.5, output_type=output_type,
                generator=torch.Generator().manual_seed(0)).images


def unet_state(pipe) -> dict:
    return {k: v.clone() for k, v in pipe.unet.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer")


@pytest.fixture
def pipe(tokenizer_folder):
    return tiny_sd_pipeline(tokenizer_folder)


@pytest.fixture(scope="module")
def reference(tokenizer_folder):
    """Eager outputs of the seed-0 and seed-1 UNets (same VAE, text encoder, scheduler), and the seed-1 weights."""
    a, b = tiny_sd_pipeline(tokenizer_folder), tiny_sd_pipeline(tokenizer_folder, unet_seed=1)
    return {"latent": generate(a), "np": generate(a, "np", steps=4), "latent_b": generate(b),
            "np_b": generate(b, "np", steps=4), "weights_b": unet_state(b)}


def test_compile_matches_eager_and_switching_weights_does_not_recompile(pipe, reference, tmp_path):
    clear_shared_graphs()
    torch._dynamo.reset()
    original = tmp_path / "unet"
    pipe.unet.save_pretrained(original)  # a diffusers model folder, to switch back to later

    compiled = compile_(pipe, CompileOptions(cuda_graphs=False))
    assert set(compiled) == {"unet.forward", "vae.decode"}
    conv = pipe.unet.conv_in.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    before = dynamo_graph_count()
    image = generate(pipe, "np", steps=4)
    assert dynamo_graph_count() - before == 2  # one UNet graph (CFG batch), one VAE decode graph
    assert relative_error(image, reference["np"]) < COMPILE_RTOL

    graphs = dynamo_graph_count()
    switch_weights_(pipe, reference["weights_b"])
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)  # the layout the graph expects
    image_b = generate(pipe, "np", steps=4)
    assert relative_error(image_b, reference["np_b"]) < COMPILE_RTOL  # = a fresh pipeline with those weights
    assert relative_error(image_b, image) > 0.05
    assert dynamo_graph_count() == graphs and compiled["unet.forward"].graph.graphs_compiled == 1

    # Another architecture is refused with the keys named, and nothing changes.
    state = unet_state(pipe)
    other = tiny_unet(cross_attention_dim=16).state_dict()
    with pytest.raises(WeightMismatchError, match=r"other shapes.*attn2\.to_k\.weight"):
        switch_weights_(pipe, other)
    assert same_state(unet_state(pipe), state)

    switch_weights_(pipe, original)  # back from a diffusers folder on disk
    assert relative_error(generate(pipe, "np", steps=4), reference["np"]) < COMPILE_RTOL
    assert dynamo_graph_count() == graphs


def test_precompile_runs_the_unet_through_a_saved_frame(pipe, reference):
    """CompileOptions(precompile=True) on a pipeline: the UNet's call is precompiled (its arguments are all keyable),
    matches eager, and switched weights go through the same frame. (The pipeline passes its torch.Generator to
    vae.decode, an object a frame cannot key: the VAE goes through torch.compile with its guards.)"""
    clear_shared_graphs()
    torch._dynamo.reset()
    compiled = compile_(pipe, CompileOptions(cuda_graphs=False, precompile=True))
    assert relative_error(generate(pipe, "np", steps=4), reference["np"]) < COMPILE_RTOL
    frames = compiled["unet.forward"].graph.frames
    assert frames.failure is None and len(frames.frames) == 1
    graphs = dynamo_graph_count()
    switch_weights_(pipe, reference["weights_b"])
    assert relative_error(generate(pipe, "np", steps=4), reference["np_b"]) < COMPILE_RTOL
    assert dynamo_graph_count() == graphs


def test_deepcache_interval_1_is_exact_and_interval_3_is_bounded(pipe, reference):
    runner = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=1))
    assert pipe.unet.forward is runner
    assert torch.equal(generate(pipe), reference["latent"])  # full path = the model's own forward, bit for bit
    assert runner.disabled is None
    assert runner.stats.decisions == [True] * STEPS and (runner.stats.full_calls, runner.stats.shallow_calls) == (10, 0)

    runner = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=3))
    latent = generate(pipe)
    stats = runner.stats
    assert stats.decisions == [True, False, False] * 3 + [True]
    assert (stats.full_calls, stats.shallow_calls, stats.fallback_calls) == (4, 6, 0)  # cond+uncond in one call
    error = relative_error(latent, reference["latent"])
    assert 0 < error < DEEPCACHE_RTOL, error

    # A second pipeline call is a new run (the timestep went up): the same schedule and the same result.
    assert torch.equal(generate(pipe), latent)
    assert runner.schedule.runs == 2 and runner.last_stats.decisions == stats.decisions

    # Deeper caching runs more of the UNet on shallow steps: closer to eager.
    deeper = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=3, cache_depth=3))
    assert relative_error(generate(pipe), reference["latent"]) < error
    assert deeper.stats.shallow_calls == 6


def test_quantize_int8_is_bounded_and_weights_switch_into_the_quantized_unet(pipe, reference):
    state = unet_state(pipe)
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_(pipe, QuantConfig(format="int8"))
    assert same_state(unet_state(pipe), state)

    report = quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0), calibration=CALIBRATION)
    assert len(report.quantized) > 40 and report.calibrated
    latent = generate(pipe)
    error = relative_error(latent, reference["latent"])
    assert 0 < error < INT8_RTOL, error

    # Float weights of another checkpoint: copied, and re-quantized into the quantized layers.
    switch_weights_(pipe, reference["weights_b"])
    assert relative_error(generate(pipe), reference["latent_b"]) < INT8_RTOL
    with pytest.raises(WeightMismatchError):
        switch_weights_(pipe, tiny_unet(block_out_channels=(32, 32)).state_dict())


def test_switching_to_weights_with_nan_or_inf_names_the_layers_and_goes_on(pipe, caplog):
    state = unet_state(pipe)
    poisoned = sorted(name for name, tensor in state.items() if tensor.is_floating_point())[:2]
    state[poisoned[0]].view(-1)[0], state[poisoned[1]].view(-1)[-1] = float("nan"), float("inf")
    with caplog.at_level(logging.WARNING, logger="overdrive"):
        switch_weights_(pipe, state)
    (warning,) = [record.getMessage() for record in caplog.records if "NaN or Inf" in record.getMessage()]
    assert "2 of the" in warning and all(name in warning for name in poisoned), warning
    assert unet_state(pipe)[poisoned[0]].isnan().any()  # switched all the same


def test_deepcache_skips_calls_it_cannot_mirror_and_refuses_unsupported_unets():
    unet = tiny_unet()
    for mode in ("adaptive", "calibrated"):  # measured on a DiT's first blocks: a UNet has none
        with pytest.raises(DeepCacheConfigError, match=f"mode='{mode}' applies to DiT transformers"):
            deepcache_(unet, DeepCacheConfig(mode=mode))
        assert "forward" not in unet.__dict__
    runner = deepcache_(unet, DeepCacheConfig(mode="fixed", cache_interval=2))
    x, context = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 32)
    residuals = tuple(torch.zeros(2, c, 8 // s, 8 // s) for c, s in ((32, 1), (32, 1), (32, 2), (64, 2)))
    out = unet(x, 900, context, down_block_additional_residuals=residuals,
               mid_block_additional_residual=torch.zeros(2, 64, 4, 4))
    assert torch.equal(out.sample, type(unet).forward(unet, x, 900, context).sample)
    assert runner.stats.full_calls == 1 and runner.stats.shallow_calls == 0

    # A shallow step with nothing cached for it (the last full call ran the native forward) runs full: exact.
    keyword = unet(sample=x, timestep=torch.tensor(800), encoder_hidden_states=context, return_dict=False)
    assert isinstance(keyword, tuple) and (runner.stats.shallow_calls, runner.stats.fallback_calls) == (0, 1)
    assert torch.equal(keyword[0], type(unet).forward(unet, x, 800, context).sample)

    odd = tiny_unet(down_block_types=("SimpleCrossAttnDownBlock2D", "DownBlock2D"))
    with pytest.raises(UnsupportedUNetError, match="SimpleCrossAttnDownBlock2D"):
        deepcache_(odd)
    assert "forward" not in odd.__dict__


def test_unknown_targets_are_refused_and_left_unchanged(pipe):
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel
    torch.manual_seed(0)
    unconditional = DDPMPipeline(unet=UNet2DModel(sample_size=8, block_out_channels=(32, 64), norm_num_groups=8,
                                                  down_block_types=("DownBlock2D", "DownBlock2D"),
                                                  up_block_types=("UpBlock2D", "UpBlock2D")),
                                 scheduler=DDPMScheduler())
    state = {k: v.clone() for k, v in unconditional.unet.state_dict().items()}
    calls = [lambda t: compile_(t), lambda t: deepcache_(t), lambda t: switch_weights_(t, state),
             lambda t: quantize_(t, QuantConfig(), calibration={"prompt": "x"})]
    for call in calls:
        with pytest.raises(TypeError, match="no UNet2DConditionModel `unet`"):
            call(unconditional)
        with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
            call("not a model")
    assert "forward" not in unconditional.unet.__dict__ and same_state(unconditional.unet.state_dict(), state)

    with pytest.raises(TypeError, match="needs a diffusers UNet2DConditionModel"):
        deepcache_(pipe.vae)
    with pytest.raises(TypeError, match="CompileOptions"):
        compile_(pipe, {"mode": "default"})
    with pytest.raises(ValueError, match="no method"):
        compile_(pipe.vae, methods=("render",))
    assert not {"forward", "decode"} & (set(pipe.unet.__dict__) | set(pipe.vae.__dict__))
    assert isinstance(deepcache_(pipe), DeepCacheRunner)


def test_compile_deepcache_and_quantize_compose_in_any_order(pipe):
    """Dynamo's own 'eager' backend (no Inductor codegen: seconds on a CPU) checks the wiring: DeepCache's paths get
    compiled once each, without graph breaks, and quantizing re-fingerprints the compiled code for the new layers."""
    from torch._dynamo.utils import counters
    clear_shared_graphs()
    torch._dynamo.reset()
    runner = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=3))
    expected = generate(pipe, steps=6)
    compiled = compile_(pipe, CompileOptions(backend="eager", cuda_graphs=False))
    assert compiled["unet.forward"] is runner.native and compiled["unet.deepcache.full_forward"] is runner.full_path
    breaks = sum(counters["graph_break"].values())
    # not bit-equal: compile_ moves the conv weights to channels-last, so the convolutions take other algorithms
    assert relative_error(generate(pipe, steps=6), expected) < COMPILE_RTOL
    assert runner.full_path.graph.graphs_compiled == 1 and runner.shallow_path.graph.graphs_compiled == 1
    assert sum(counters["graph_break"].values()) == breaks

    fingerprint = runner.full_path.fingerprint
    quantize_(pipe, QuantConfig(format="int8", compute_density_threshold=0), calibration=CALIBRATION)
    assert pipe.unet.forward is runner and runner.full_path.fingerprint != fingerprint
    assert relative_error(generate(pipe, steps=6), expected) < INT8_RTOL
    assert runner.stats.decisions == [True, False, False] * 2 and runner.full_path.graph.graphs_compiled == 1


def test_switch_weights_from_a_single_file_checkpoint():
    """An LDM-layout single-file checkpoint (the built-in tiny SD1.5 one, the same file the ComfyUI tests load) is
    converted with diffusers' own converter into a UNet of that architecture; another UNet refuses it untouched."""
    from safetensors import safe_open

    from overdrive.builtin_models import ensure_checkpoint
    path = ensure_checkpoint("sd15", "tiny", seed=0)
    sd15_tiny = tiny_unet(block_out_channels=(320, 640), cross_attention_dim=768, norm_num_groups=32,
                          down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                          up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"))
    switch_weights_(sd15_tiny, path)
    with safe_open(str(path), framework="pt") as f:
        to_k = f.get_tensor("model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight")
        conv_out = f.get_tensor("model.diffusion_model.out.2.weight")
    assert torch.equal(sd15_tiny.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k.weight, to_k.float())
    assert torch.equal(sd15_tiny.conv_out.weight, conv_out.float())

    small = tiny_unet()
    state = {k: v.clone() for k, v in small.state_dict().items()}
    with pytest.raises(WeightMismatchError, match="does not match the running model's architecture"):
        switch_weights_(small, path)
    assert same_state(small.state_dict(), state)

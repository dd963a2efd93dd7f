"""DeepCache core on ComfyUI's real UNetModel (tiny SD1.5-like config, fixed-seed weights), in-process on the CPU.

Stated bound: on this tiny random-weight UNet and the coarse 10-step schedule below (sigma halves at every step), a
shallow step's output differs from the plain forward at the same step by a relative L2 error in (0, SHALLOW_RTOL = 1.0]
at depth 1 (measured 0.16-0.84; it shrinks at every step as the depth grows: 0.11-0.61 at depth 4), and a whole
10-step euler sampling at interval 3 ends 0.34 (relative) from the plain latent. Random weights have much less
step-to-step coherence in their deep features than a trained model, so these are loose; full steps are bit-identical
(torch.equal), and so is every step at cache_interval=1.
"""
import copy
import logging
import math

import pytest
import torch

from overdrive.comfy_host.comfy_call_options import COMFY_CALL_OPTIONS
from overdrive.step_cache import (DeepCacheConfig, DeepCacheConfigError, DeepCacheRunner, DeepCacheSchedule,
                                  DeepCacheUnsupportedError)

SHALLOW_RTOL = 1.0
COMPILE_RTOL = 1e-4  # compiled (inductor, float32 CPU) vs eager; measured ~1.5e-6
STEPS = 10
TINY_UNET = dict(use_checkpoint=False, image_size=32, use_spatial_transformer=True, legacy=False,
                 use_temporal_resblock=False, use_temporal_attention=False, adm_in_channels=None, in_channels=4,
                 out_channels=4, model_channels=32, num_res_blocks=[1, 1], transformer_depth=[1, 1],
                 transformer_depth_output=[1, 1, 1, 1], channel_mult=[1, 2], transformer_depth_middle=1,
                 use_linear_in_transformer=False, context_dim=32)


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def seeded_(module, seed):
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        elif p.ndim <= 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / max(p[0].numel(), 1)) ** 0.5)


class Tiny:
    """ComfyUI's own SD15 model class around a 32-channel, 2-level UNetModel (4 input / 4 output blocks)."""

    def __init__(self, comfy):
        import comfy.model_management
        import comfy.model_patcher
        import comfy.supported_models
        from comfy.ldm.modules.diffusionmodules.openaimodel import forward_timestep_embed
        from comfy.ldm.modules.diffusionmodules.util import timestep_embedding

        model_config = comfy.supported_models.SD15(dict(TINY_UNET))
        model_config.set_inference_dtype(torch.float32, None)
        self.model = model_config.get_model({}, "")
        self.unet = self.model.diffusion_model
        seeded_(self.unet, 0)
        self.unet.eval().requires_grad_(False)
        self.ms = self.model.model_sampling
        self.fte, self.temb = forward_timestep_embed, timestep_embedding
        mm = comfy.model_management
        self.patcher = comfy.model_patcher.ModelPatcher(self.model, load_device=mm.get_torch_device(),
                                                        offload_device=mm.unet_offload_device())
        g = torch.Generator().manual_seed(1)
        self.x0, self.noise = torch.randn(1, 4, 16, 16, generator=g), torch.randn(1, 4, 16, 16, generator=g)
        self.cond, self.uncond = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
        # A Karras-like decreasing schedule over this model's sigma range, as a sampler would evaluate it.
        hi, lo = float(self.ms.sigma_max), float(self.ms.sigma_min)
        self.sigmas = [math.exp(math.log(hi) + (math.log(lo) - math.log(hi)) * i / (STEPS - 1)) for i in range(STEPS)]

    def runner(self, unet=None, **config):
        return DeepCacheRunner.for_openai_unet(unet or self.unet, DeepCacheConfig(**config),
                                               forward_timestep_embed=self.fte, timestep_embedding=self.temb,
                                               percent_to_sigma=self.ms.percent_to_sigma,
                                               call_options=COMFY_CALL_OPTIONS)  # as the ComfyUI host makes it

    def inputs(self, sigma, layout=(0, 1), size=16):
        """What ComfyUI's apply_model hands the UNet at `sigma` for the conds in `layout` (0 = cond, 1 = uncond)."""
        x0, noise = self.x0, self.noise
        if size != 16:
            x0, noise = (torch.nn.functional.interpolate(t, size=(size, size)) for t in (x0, noise))
        n = len(layout)
        s = torch.full((n,), float(sigma))
        x = ((x0 + sigma * noise) / (sigma ** 2 + 1) ** 0.5).repeat(n, 1, 1, 1)
        context = torch.cat([self.cond if c == 0 else self.uncond for c in layout])
        t = self.ms.timestep(s).float()
        return (x, t), dict(context=context, transformer_options={"sigmas": s, "cond_or_uncond": list(layout)})

    @torch.no_grad()
    def plain(self, sigma, layout=(0, 1), size=16, **extra):
        # (ComfyUI's unpatch leaves the bound class forward as an instance attribute; a runner must not be there.)
        assert not isinstance(self.unet.__dict__.get("forward"), DeepCacheRunner), "object patch left on the UNet"
        args, kwargs = self.inputs(sigma, layout, size)
        return self.unet(*args, **kwargs, **extra)

    @torch.no_grad()
    def step(self, runner, sigma, layout=(0, 1), size=16, **extra):
        args, kwargs = self.inputs(sigma, layout, size)
        return runner(*args, **kwargs, **extra)


@pytest.fixture(scope="module")
def tiny(comfy):
    return Tiny(comfy)


# -- config and schedule ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    (dict(cache_interval=0), "cache_interval must be >= 1"),
    (dict(cache_interval=2.5), "cache_interval must be an int"),
    (dict(cache_depth=0), "cache_depth must be >= 1"),
    (dict(start_percent=0.5, end_percent=0.5), "must be < end_percent"),
    (dict(start_percent=0.8, end_percent=0.2), "must be < end_percent"),
    (dict(end_percent=1.5), "end_percent must be a number in [0, 1]"),
    (dict(on_unsupported="ignore"), "on_unsupported must be one of"),
])
def test_config_refuses_bad_values_with_clear_errors(kwargs, words):
    with pytest.raises(DeepCacheConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        DeepCacheConfig(**kwargs)


def test_depth_must_fit_this_unet_and_window_needs_sigmas(tiny):
    assert len(tiny.unet.input_blocks) == len(tiny.unet.output_blocks) == 4
    with pytest.raises(DeepCacheConfigError, match=r"out of range for this UNet: it has 4 skip branches"):
        tiny.runner(cache_depth=5)
    tiny.runner(cache_depth=4)  # 4 = skip only the middle block
    with pytest.raises(DeepCacheConfigError, match="percent_to_sigma"):
        DeepCacheSchedule(DeepCacheConfig(start_percent=0.2))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_deferred_floats_read_every_tensor_s_values_in_order(device):
    from overdrive.step_cache.schedule import DeferredFloats, host_floats

    tensors = [torch.tensor([0.5, 2.0], device=device), torch.tensor(3.25, dtype=torch.bfloat16, device=device),
               torch.arange(6, device=device).reshape(2, 3)]
    pending = DeferredFloats(tensors)
    later = torch.full_like(tensors[0], 9.0)
    tensors[0].copy_(later)  # queued after the copy: the values are those at construction
    assert pending.values() == [[0.5, 2.0], [3.25], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    assert pending.values() is pending.values()
    assert host_floats(tensors[:1]) == [[9.0, 9.0]]


def test_schedule_decisions_are_keyed_on_sigma_and_follow_interval_and_window():
    sigmas = [10.0 - i for i in range(STEPS)]  # 10 .. 1
    schedule = DeepCacheSchedule(DeepCacheConfig(mode="fixed", cache_interval=3))
    assert schedule.plan(sigmas) == [True, False, False, True, False, False, True, False, False, True]
    for s in sigmas:
        first = schedule.decide(s, "run")
        again = schedule.decide(s, "run")  # the uncond call of the same step
        assert again.full == first.full and again.step == first.step and not again.new_step
    assert schedule.stats.decisions == schedule.plan(sigmas)
    assert (schedule.stats.full_steps, schedule.stats.shallow_steps) == (4, 6)

    # Window 20%..80% with a linear percent -> sigma map (10 at 0%, 0 at 100%): sigma in [2, 8] may be cached.
    windowed = DeepCacheSchedule(DeepCacheConfig(mode="fixed", cache_interval=3, start_percent=0.2, end_percent=0.8),
                                 percent_to_sigma=lambda p: 10.0 * (1.0 - p))
    # sigmas 10, 9 outside (full); 8..2 inside: full at the 1st and 4th and 7th in-window step; 1 outside (full).
    expected = [True, True, True, False, False, True, False, False, True, True]
    assert windowed.plan(sigmas) == expected
    for s in sigmas:
        windowed.decide(s, "run")
    assert windowed.stats.decisions == expected
    assert (windowed.stats.full_steps, windowed.stats.shallow_steps) == (6, 4)

    # A new run: sigma goes up, or the run key (shape, dtype, device) changes.
    assert windowed.decide(10.0, "run").new_run and windowed.last_stats.steps == STEPS
    assert not windowed.decide(9.0, "run").new_run
    assert windowed.decide(8.5, "other shape").new_run


# -- the runner on ComfyUI's UNetModel ----------------------------------------------------------------------------

def test_interval_1_is_bit_identical_to_the_plain_forward(tiny):
    runner = tiny.runner(cache_interval=1)
    for sigma in tiny.sigmas:
        assert torch.equal(tiny.step(runner, sigma), tiny.plain(sigma))
    assert runner.stats.decisions == [True] * STEPS and runner.stats.shallow_calls == 0
    assert runner.disabled is None


def test_interval_3_counts_full_steps_exact_and_shallow_steps_bounded(tiny, caplog):
    runner = tiny.runner(cache_interval=3)
    errors = []
    for sigma in tiny.sigmas:
        out, ref = tiny.step(runner, sigma), tiny.plain(sigma)
        if runner.stats.decisions[-1]:
            assert torch.equal(out, ref)
        else:
            errors.append(relative_error(out, ref))
    assert runner.stats.decisions == [True, False, False] * 3 + [True]
    assert (runner.stats.full_calls, runner.stats.shallow_calls, runner.stats.fallback_calls) == (4, 6, 0)
    assert len(errors) == 6 and all(0.0 < e <= SHALLOW_RTOL for e in errors), errors
    assert len(runner.cache) == 1  # one feature for the one (batched cond+uncond) layout
    kept = runner.cache.nbytes()
    assert runner.stats.kept_bytes == kept > 0  # the one deep feature is all the run keeps between steps

    with caplog.at_level(logging.INFO, logger="overdrive.step_cache"):
        runner.reset()
    assert "DeepCache: 10 steps, 4 full / 6 shallow, interval 3, depth 1" in caplog.text
    assert f"kept {kept / 2**20:.2f} MiB between steps" in caplog.text
    assert len(runner.cache) == 0

    # Deeper caching runs more of the UNet on shallow steps: closer to the plain forward.
    deep = tiny.runner(cache_interval=3, cache_depth=4)
    deep_errors = [relative_error(tiny.step(deep, s), tiny.plain(s)) for s in tiny.sigmas]
    deep_errors = [e for e, full in zip(deep_errors, deep.stats.decisions) if not full]
    assert sum(deep_errors) < sum(errors)


def test_window_counts_match_the_plan(tiny):
    runner = tiny.runner(cache_interval=2, start_percent=0.3, end_percent=0.9)
    for sigma in tiny.sigmas:
        tiny.step(runner, sigma)
    plan = runner.schedule.plan(tiny.sigmas)
    assert runner.stats.decisions == plan
    assert plan[0] and plan[-1] and not all(plan) and runner.stats.shallow_calls == plan.count(False)


def test_batched_and_separate_cond_uncond_share_decisions(tiny):
    batched, separate = tiny.runner(cache_interval=3), tiny.runner(cache_interval=3)
    for sigma in tiny.sigmas:
        both = tiny.step(batched, sigma, layout=(0, 1))
        cond = tiny.step(separate, sigma, layout=(0,))
        uncond = tiny.step(separate, sigma, layout=(1,))
        assert relative_error(torch.cat([cond, uncond]), both) < 1e-5
    assert batched.stats.decisions == separate.stats.decisions == [True, False, False] * 3 + [True]
    assert (separate.stats.full_calls, separate.stats.shallow_calls) == (8, 12)
    assert len(separate.cache) == 2  # one feature per layout


def test_cache_resets_on_new_run_and_new_shape(tiny):
    runner = tiny.runner(cache_interval=3)
    for sigma in tiny.sigmas[:5]:
        tiny.step(runner, sigma)
    # Another latent size, even at a lower sigma: a new run; its first step is full and exact, no stale feature.
    low = tiny.sigmas[6]
    assert torch.equal(tiny.step(runner, low, size=24), tiny.plain(low, size=24))
    assert runner.last_stats.steps == 5 and runner.stats.decisions == [True]
    assert all(t.shape[-1] == 24 for t in runner.cache._entries.values())
    out = tiny.step(runner, tiny.sigmas[7], size=24)
    assert runner.stats.decisions == [True, False] and out.shape[-1] == 24
    # Back at the first shape with sigma going up: a new run again.
    assert torch.equal(tiny.step(runner, tiny.sigmas[0]), tiny.plain(tiny.sigmas[0]))
    assert runner.last_stats.steps == 2 and runner.stats.decisions == [True]
    assert runner.schedule.runs == 3


def test_cache_resets_when_the_weights_are_replaced(tiny):
    """ComfyUI patches weights (LoRA) by installing new Parameter objects: a feature of other weights is not reused."""
    unet = copy.deepcopy(tiny.unet)
    runner = tiny.runner(unet=unet, cache_interval=3)
    tiny.step(runner, tiny.sigmas[0])
    conv = unet.input_blocks[0][0]
    conv.weight = torch.nn.Parameter(conv.weight * 1.1, requires_grad=False)
    out = tiny.step(runner, tiny.sigmas[1])  # would be shallow in the same run
    assert runner.schedule.runs == 2 and runner.stats.decisions == [True]
    args, kwargs = tiny.inputs(tiny.sigmas[1])
    with torch.no_grad():
        assert torch.equal(out, unet(*args, **kwargs))


def test_weights_are_walked_only_after_something_was_registered(tiny, monkeypatch):
    """The per-step weights check is one integer comparison; the module walk runs again only after a Parameter or
    submodule was registered somewhere (here: a module swapped in, as QuantizeModel does), and then sees it."""
    from overdrive.core import weights_watch as weights
    unet = copy.deepcopy(tiny.unet)
    runner = tiny.runner(unet=unet, cache_interval=3)
    walks = []
    real_walk = weights.weights_token
    monkeypatch.setattr(weights, "weights_token", lambda module: walks.append(1) or real_walk(module))
    for sigma in tiny.sigmas[:3]:
        tiny.step(runner, sigma)
    assert len(walks) <= 1 and runner.stats.decisions == [True, False, False]
    block = unet.output_blocks[-1]
    block[0] = copy.deepcopy(block[0])  # same values, another module object
    tiny.step(runner, tiny.sigmas[3])
    assert len(walks) == 2 and runner.schedule.runs == 2 and runner.stats.decisions == [True]


class _SlicesItsLayers(torch.nn.Module):
    """Builds a temporary ModuleList in every forward, as diffusers' UNetMidBlock2DCrossAttn does (`self.resnets[1:]`)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[1:]:
            x = layer(x)
        return x


def test_temporary_containers_in_a_forward_are_not_weight_changes_and_do_not_recompile():
    """Regression (H100, torch 2.11): the registration hook ran inside the compiled diffusers UNet, Dynamo guarded on
    the counter and recompiled every call until its limit, and SDXL ran eager (3.2 s/image instead of ~0.8 s)."""
    from overdrive.compiler import CompileOptions, compile_module, dynamo_graph_count
    from overdrive.core.weights_watch import weights_generation
    model, x = _SlicesItsLayers(), torch.randn(2, 4)
    generation = weights_generation()
    with torch.no_grad():
        eager = model(x)
        compile_module(model, CompileOptions(backend="eager", cuda_graphs=False, regional=False))
        graphs = dynamo_graph_count()
        for _ in range(4):
            assert torch.equal(model(x), eager)
    assert dynamo_graph_count() - graphs == 1
    assert weights_generation() == generation
    model.layers[0] = torch.nn.Linear(4, 4)  # a real swap still counts
    assert weights_generation() > generation


def test_a_new_layout_in_a_shallow_step_runs_full_instead_of_reusing_another(tiny):
    runner = tiny.runner(cache_interval=3)
    tiny.step(runner, tiny.sigmas[0], layout=(0, 1))
    # Shallow step, but this layout (cond alone) had no full step: it must not reuse the batched feature.
    out = tiny.step(runner, tiny.sigmas[1], layout=(0,))
    assert torch.equal(out, tiny.plain(tiny.sigmas[1], layout=(0,)))
    assert runner.stats.fallback_calls == 1 and runner.stats.decisions == [True, False]


def _control(tiny, sigma):
    """A factory of ControlNet-style residuals with this UNet's real shapes ({"input", "middle", "output"} lists,
    "output" in input-block order as ComfyUI's control_merge builds it); each call returns fresh, equal lists."""
    (x, t), kwargs = tiny.inputs(sigma)
    unet = tiny.unet
    shapes = []
    with torch.no_grad():
        emb = unet.time_embed(tiny.temb(t, unet.model_channels).to(x.dtype))
        h = x
        for block in unet.input_blocks:
            h = tiny.fte(block, h, emb, kwargs["context"], {})
            shapes.append(h.shape)
        middle = tiny.fte(unet.middle_block, h, emb, kwargs["context"], {}).shape

    def make():
        g = torch.Generator().manual_seed(5)
        return {"input": [], "middle": [torch.randn(middle, generator=g) * 0.1],
                "output": [torch.randn(s, generator=g) * 0.1 for s in shapes]}
    return make


def test_control_residuals_run_the_full_model_or_raise(tiny, caplog):
    runner = tiny.runner(cache_interval=3)
    tiny.step(runner, tiny.sigmas[0])  # full step, feature cached
    control = _control(tiny, tiny.sigmas[1])
    with caplog.at_level(logging.WARNING, logger="overdrive.step_cache"):
        out = tiny.step(runner, tiny.sigmas[1], control=control())  # a shallow step with ControlNet residuals
    assert "ControlNet" in caplog.text
    assert runner.stats.decisions == [True, False] and runner.stats.fallback_calls == 1
    assert list(runner.stats.fallback_reasons)[0].startswith("ControlNet")
    assert torch.equal(out, tiny.plain(tiny.sigmas[1], control=control()))  # the plain forward with the residuals
    assert relative_error(out, tiny.plain(tiny.sigmas[1])) > 1e-3  # and the residuals did matter

    strict = tiny.runner(cache_interval=3, on_unsupported="error")
    with pytest.raises(DeepCacheUnsupportedError, match="ControlNet"):
        tiny.step(strict, tiny.sigmas[0], control=control())


def test_unknown_patches_and_a_drifted_forward_are_loud_not_silent(tiny, caplog):
    # A patch key this DeepCache does not implement (a newer ComfyUI's forward-level patch): the model's own forward.
    runner = tiny.runner(cache_interval=3)
    args, kwargs = tiny.inputs(tiny.sigmas[0])
    kwargs["transformer_options"]["patches"] = {"emb_patch": [lambda emb, channels, options: emb * 2.0]}
    with caplog.at_level(logging.WARNING, logger="overdrive.step_cache"):
        with torch.no_grad():
            out = runner(*args, **kwargs)
    with torch.no_grad():  # the model's own forward with the same patches (ComfyUI's UNet applies emb_patch there)
        own = tiny.unet(*args, **kwargs)
    assert "emb_patch" in caplog.text and torch.equal(out, own)

    # An entry that only rides along in the patches (QuantizeModel's device follower says forward_inert) does not
    # stop caching: shallow steps still run.
    class RidesAlong:
        forward_inert = True

    runner = tiny.runner(cache_interval=3)
    for sigma in tiny.sigmas[:3]:
        args, kwargs = tiny.inputs(sigma)
        kwargs["transformer_options"]["patches"] = {"overdrive_quantized": [RidesAlong()]}
        with torch.no_grad():
            runner(*args, **kwargs)
    assert runner.stats.shallow_calls == 2 and runner.stats.fallback_calls == 0

    # A UNet whose forward does something the mirror does not (as a newer ComfyUI might): verification turns
    # DeepCache off for it, with an error, and every call runs that model's own forward.
    class DriftedUNet(type(tiny.unet)):
        def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
            return super().forward(x, timesteps * 1.01, context, y, control, transformer_options, **kwargs)

    drifted = copy.deepcopy(tiny.unet)
    drifted.__class__ = DriftedUNet
    runner = tiny.runner(unet=drifted, cache_interval=3)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="overdrive.step_cache"):
        outs = [tiny.step(runner, s) for s in tiny.sigmas[:3]]
    assert "DeepCache is OFF" in caplog.text and runner.disabled
    with torch.no_grad():
        for s, out in zip(tiny.sigmas[:3], outs):
            args, kwargs = tiny.inputs(s)
            assert torch.equal(out, drifted(*args, **kwargs))
    with pytest.raises(DeepCacheUnsupportedError, match="differs from the model's own forward"):
        tiny.step(tiny.runner(unet=drifted, on_unsupported="error"), tiny.sigmas[0])


def test_in_place_output_patch_freeu_is_exact_and_never_corrupts_the_cache(tiny, comfy):
    from comfy_extras.nodes_freelunch import FreeU
    patched = FreeU().patch(tiny.patcher, b1=1.3, b2=1.4, s1=0.9, s2=0.2)[0]  # only its patch function is used
    patches = patched.model_options["transformer_options"]["patches"]
    assert patches.get("output_block_patch")

    def call(fn, sigma):
        args, kwargs = tiny.inputs(sigma)
        kwargs["transformer_options"]["patches"] = patches
        with torch.no_grad():
            return fn(*args, **kwargs)

    # Depth 2: the cached h (64 channels) is exactly what FreeU scales in place at output block 2.
    runner = tiny.runner(cache_interval=3, cache_depth=2)
    assert torch.equal(call(runner, tiny.sigmas[0]), call(tiny.unet, tiny.sigmas[0]))
    assert relative_error(call(tiny.unet, tiny.sigmas[0]), call(tiny.unet.__class__.forward.__get__(tiny.unet),
                                                                tiny.sigmas[0])) == 0
    cached = [t.clone() for t in runner.cache._entries.values()]
    first = call(runner, tiny.sigmas[1])
    second = call(runner, tiny.sigmas[1])  # the same step again (e.g. a second-order sampler): no compounding
    assert torch.equal(first, second)
    assert all(torch.equal(a, b) for a, b in zip(cached, runner.cache._entries.values()))
    assert runner.stats.shallow_calls == 2 and runner.disabled is None


def test_sampling_through_comfyui_with_the_runner_as_an_object_patch(tiny, comfy):
    """The adapter's install path: ModelPatcher.add_object_patch("diffusion_model.forward", runner)."""
    import comfy.sample

    latent = torch.zeros(1, 4, 16, 16)
    noise = comfy.sample.prepare_noise(latent, 3)
    positive, negative = [[tiny.cond, {}]], [[tiny.uncond, {}]]

    def sample(model, negative=negative):
        return comfy.sample.sample(model, noise, STEPS, 7.0, "euler", "normal", positive, negative, latent, seed=3,
                                   disable_pbar=True)

    def with_runner(runner):
        model = tiny.patcher.clone()
        model.add_object_patch("diffusion_model.forward", runner)
        return model

    try:
        _sample_with_runners(tiny, comfy, sample, with_runner)
    finally:
        import comfy.model_management
        comfy.model_management.unload_all_models()  # undoes the object patch on the shared UNet
    assert not isinstance(tiny.unet.__dict__.get("forward"), DeepCacheRunner)


def _sample_with_runners(tiny, comfy, sample, with_runner):
    plain = sample(tiny.patcher.clone())
    exact = tiny.runner(cache_interval=1)
    assert torch.equal(sample(with_runner(exact)), plain)
    assert exact.stats.steps == STEPS and exact.stats.full_calls == STEPS

    window = dict(cache_interval=3, start_percent=0.2, end_percent=0.8)
    cached = tiny.runner(**window)
    out = sample(with_runner(cached))
    stats = cached.stats
    sigmas = comfy.samplers.calculate_sigmas(tiny.ms, "normal", STEPS)[:-1].tolist()
    assert stats.steps == STEPS and stats.decisions == cached.schedule.plan(sigmas)
    # Outside 20%..80% (ComfyUI's percent_to_sigma) every step is full; inside, every third.
    inside = [cached.schedule.in_window(s) for s in sigmas]
    assert not all(inside) and any(inside)
    assert all(full for full, i in zip(stats.decisions, inside) if not i)
    assert stats.shallow_calls == stats.shallow_steps > 0 and stats.fallback_calls == 0
    assert 0 < relative_error(out, plain) < SHALLOW_RTOL

    # Conds that cannot be batched (8 vs 77 tokens) arrive as separate calls: same decisions, twice the calls.
    long_uncond = [[torch.randn(1, 77, 32, generator=torch.Generator().manual_seed(9)), {}]]
    separate = tiny.runner(**window)
    sample(with_runner(separate), long_uncond)
    assert separate.stats.decisions == stats.decisions
    assert separate.stats.shallow_calls == 2 * stats.shallow_calls and separate.stats.fallback_calls == 0
    # A second sampling run with the same runner starts over (sigma went up): same decisions again.
    sample(with_runner(separate), long_uncond)
    assert separate.last_stats.steps == STEPS and separate.stats.decisions == stats.decisions
    # The object patch is live while the clone is loaded: the shared UNet's forward is the runner itself.
    assert tiny.unet.__dict__.get("forward") is separate
    copied = copy.deepcopy(tiny.unet)  # a deep copy gets its own runner over the copied UNet
    assert isinstance(copied.forward, DeepCacheRunner) and copied.forward.paths.unet is copied


def test_compiled_paths_two_graphs_no_recompile_per_step(tiny):
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    compiled_graphs = []

    def counting_inductor(gm, example_inputs):
        compiled_graphs.append(gm)
        return compile_fx(gm, example_inputs)

    def compile_paths(runner):  # as the compile stack routes them (core/stack.py)
        runner.full_path = torch.compile(runner.paths.full_forward, backend=counting_inductor)
        runner.shallow_path = torch.compile(runner.paths.shallow_forward, backend=counting_inductor)

    runner, eager = tiny.runner(cache_interval=3), tiny.runner(cache_interval=3)
    compile_paths(runner)
    breaks = sum(counters["graph_break"].values())
    for sigma in tiny.sigmas:
        out, ref = tiny.step(runner, sigma), tiny.step(eager, sigma)
        assert relative_error(out, ref) < COMPILE_RTOL
    assert runner.stats.decisions == eager.stats.decisions and runner.stats.shallow_calls == 6
    assert len(compiled_graphs) == 2  # one full, one shallow: no recompile per step
    assert sum(counters["graph_break"].values()) == breaks
    # A second run at the same shape reuses both graphs; so does a clone (e.g. a second node's runner).
    for sigma in tiny.sigmas[:4]:
        tiny.step(runner, sigma)
    assert len(compiled_graphs) == 2 and runner.schedule.runs == 2
    twin = runner.clone()
    compile_paths(twin)
    for sigma in tiny.sigmas[:4]:
        assert relative_error(tiny.step(twin, sigma), tiny.step(eager, sigma)) < COMPILE_RTOL
    assert twin.stats.decisions == [True, False, False, True] and twin.schedule.runs == 1
    assert len(compiled_graphs) == 2


def test_layers_swapped_inside_blocks_are_used_on_both_paths(tiny):
    """Quantization swaps modules inside blocks: both paths call the blocks, so they run whatever is installed."""

    class FakeQuantLinear(torch.nn.Module):  # int8-style weight rounding, as a stand-in for a quantized layer
        def __init__(self, linear):
            super().__init__()
            scale = linear.weight.abs().amax(dim=1, keepdim=True) / 127
            self.register_buffer("weight_q", torch.round(linear.weight / scale).to(torch.int8))
            self.register_buffer("scale", scale)
            self.bias = linear.bias

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight_q.float() * self.scale, self.bias)

    unet = copy.deepcopy(tiny.unet)
    for block in (unet.input_blocks[1], unet.output_blocks[3]):  # a skipped-on-shallow block and a kept one
        ff = block[1].transformer_blocks[0].ff.net[2]
        block[1].transformer_blocks[0].ff.net[2] = FakeQuantLinear(ff)
    runner = tiny.runner(unet=unet, cache_interval=3)
    with torch.no_grad():
        for sigma in tiny.sigmas[:3]:
            args, kwargs = tiny.inputs(sigma)
            out, ref = runner(*args, **kwargs), unet(*args, **kwargs)
            if runner.stats.decisions[-1]:
                assert torch.equal(out, ref)
            else:
                assert 0 < relative_error(out, ref) <= SHALLOW_RTOL
    assert runner.stats.decisions == [True, False, False] and runner.disabled is None
    assert relative_error(ref, tiny.plain(tiny.sigmas[2])) > 0  # the swapped layers did run

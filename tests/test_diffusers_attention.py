"""attention_ (overdrive.api) on real diffusers pipelines (Flux, SD) and the SDPA routing under it
(attention/routing.py), on the CPU: which calls reach torch.ops.overdrive.attention, eagerly and from compiled code, and
that the chooser's CPU answer (SDPA) leaves every result as it was. The 8-bit kernels themselves: test_attention.py and the GPU benchmarks."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from diffusers_tiny import flux_prompt, tiny_flux_pipeline, tiny_sd_pipeline
from overdrive.api import AttentionConfig, CompileOptions, DeepCacheConfig, attention_, compile_, deepcache_
from overdrive.attention.routing import RoutedSDPA, routable
from overdrive.compiler.precompiled import call_signature

STEPS = 3
BLOCKS = 3  # the tiny transformer's 1 double + 2 single blocks: one attention call each
COMPILE_RTOL = 1e-4


class OpCalls(TorchDispatchMode):
    """Counts calls of the overdrive::attention op, whoever makes them (eager code or a compiled graph)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "overdrive.attention" in str(func)
        return func(*args, **(kwargs or {}))


def generate(pipe):
    return pipe(**flux_prompt(), height=32, width=32, num_inference_steps=STEPS, guidance_scale=1.0,
                output_type="latent", generator=torch.Generator().manual_seed(1)).images


def counted(pipe):
    with OpCalls() as calls:
        out = generate(pipe)
    return out, calls.count


def test_every_unmasked_attention_call_goes_to_the_op_and_changes_no_result():
    pipe = tiny_flux_pipeline()
    expected = generate(pipe)
    attention_(pipe, AttentionConfig(mode="auto", max_error=0.05))
    out, calls = counted(pipe)
    assert calls == STEPS * BLOCKS
    assert torch.equal(out, expected)  # on the CPU the op runs SDPA


def test_the_compiled_transformer_calls_the_op_from_its_graphs_and_sdpa_mode_turns_it_off():
    pipe = tiny_flux_pipeline()
    expected = generate(pipe)
    attention_(pipe)
    compile_(pipe, CompileOptions(precompile=False))
    generate(pipe)  # compiles
    out, calls = counted(pipe)
    assert calls == STEPS * BLOCKS and ((out - expected).norm() / expected.norm()).item() < COMPILE_RTOL
    attention_(pipe, AttentionConfig(mode="sdpa"))
    out, calls = counted(pipe)
    assert calls == 0 and ((out - expected).norm() / expected.norm()).item() < COMPILE_RTOL
    assert pipe.transformer.forward.overdrive_stack.attention is None and pipe.transformer.forward.compiled


def test_only_calls_the_op_takes_are_routed():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    assert routable((q, k, v), {}) == (q, k, v)
    assert routable((), {"query": q, "key": k, "value": v, "attn_mask": None, "dropout_p": 0.0}) == (q, k, v)
    assert routable((q, k, v), {"scale": 16 ** -0.5}) == (q, k, v)
    for option in ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, {"is_causal": True}, {"dropout_p": 0.1},
                   {"scale": 1.0}, {"enable_gqa": True}):
        assert routable((q, k, v), option) is None, option
    assert routable((q.transpose(-1, -2), k, v), {}) is None  # head dim not contiguous
    with RoutedSDPA(AttentionConfig()):
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    assert torch.equal(masked, F.scaled_dot_product_attention(q, k, v))


def test_a_precompiled_frame_is_keyed_by_the_routing_around_its_call():
    x = torch.randn(2, 3)
    plain = call_signature("forward", (x,), {})
    with RoutedSDPA(AttentionConfig(max_error=0.03)):
        routed = call_signature("forward", (x,), {})
    with RoutedSDPA(AttentionConfig(max_error=0.05)):
        other = call_signature("forward", (x,), {})
    assert len({plain, routed, other}) == 3
    with torch.device("cpu"):  # a mode that says nothing of what it changes: not precompiled
        assert call_signature("forward", (x,), {}) is None


def test_a_wrong_config_is_refused_and_changes_nothing():
    pipe = tiny_flux_pipeline()
    with pytest.raises(TypeError, match="config must be an AttentionConfig"):
        attention_(pipe, {"mode": "auto"})
    assert "forward" not in pipe.transformer.__dict__


def test_a_unets_step_cache_compiled_with_routed_attention_keeps_its_statistics_and_results(tmp_path):
    """UNet2DConditionModel's processors call SDPA themselves: attention_, deepcache_ and compile_ in that order."""
    def sample(pipe):
        return pipe(prompt="a cat", num_inference_steps=4, guidance_scale=5.0, height=32, width=32,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images

    eager = tiny_sd_pipeline(tmp_path)
    deepcache_(eager, DeepCacheConfig(mode="fixed", cache_interval=2))
    expected = sample(eager)
    pipe = tiny_sd_pipeline(tmp_path)
    attention_(pipe)
    runner = deepcache_(pipe, DeepCacheConfig(mode="fixed", cache_interval=2))
    compile_(pipe, CompileOptions(precompile=False))
    sample(pipe)
    with OpCalls() as calls:
        out = sample(pipe)
    assert calls.count > 0 and runner.last_stats.shallow_steps == 2
    assert ((out - expected).norm() / expected.norm()).item() < COMPILE_RTOL

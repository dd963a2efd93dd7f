"""8-bit attention on the CPU: the scheme's math (attention.reference), the Triton kernel itself through Triton's
interpreter (fp16 P·V, where the interpreter's casts are exact), the per-shape choice rule, the custom op under
torch.compile, and ComfyUI's override: its fallbacks and how compiled blocks receive it. The kernels' speed and
their fp8 error on the GPU: bench/attention_kernels.py."""
import copy
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from overdrive.attention import op  # noqa: F401 - registers torch.ops.overdrive.attention
from overdrive.attention import reference as ref
from overdrive.attention.choice import AttentionConfig, AttentionConfigError, Measurement, considered, pick

ATTENTION_OVERRIDE = "optimized_attention_override"  # the transformer_options entry ComfyUI reads


def qkv(shape, seed=0, k_offset=0.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    return q, k + k_offset * torch.randn((1, shape[1], 1, shape[3]), generator=g), v


def test_int8_block_quantization_error_is_within_half_a_step():
    x = torch.randn(2, 3, 200, 64) * 5
    for quantize in (ref.quantize_int8_rows, lambda t: ref.quantize_int8_blocks(t, 64)):
        values, scale = quantize(x)
        assert values.abs().max() <= 127 and torch.equal(values, values.round())
        # Half a step, plus float32's rounding of x / scale and values * scale at |values| <= 127 (~2^-16 of a step).
        assert ((values * scale - x).abs() <= scale * (0.5 + 2 ** -14)).all()


def test_smoothing_k_leaves_attention_unchanged_and_rescues_int8_from_a_shared_offset():
    q, k, v = qkv((1, 2, 300, 64), k_offset=20.0)
    torch.testing.assert_close(ref.exact_attention(q, ref.smooth_k(k), v), ref.exact_attention(q, k, v),
                               rtol=1e-4, atol=1e-5)
    exact = ref.exact_attention(q, k, v)
    smoothed = ref.relative_error(ref.quantized_attention(q, k, v, pv="fp16"), exact)
    values, scale = ref.quantize_int8_blocks(k, 128)  # the same scheme without smoothing
    scores = ref.quantize_int8_rows(q)[0] @ (values * scale).transpose(-1, -2) * ref.quantize_int8_rows(q)[1]
    unsmoothed = ref.relative_error(torch.softmax(scores * 64 ** -0.5, dim=-1) @ v, exact)
    assert smoothed < 0.02 < unsmoothed, (smoothed, unsmoothed)


def test_smoothing_k_and_v_rescues_e4m3_per_head_scales_from_shared_offsets():
    """fa3_fp8.py's scheme: e4m3 rounds each value relative to its magnitude, so a K offset shared by the tokens
    costs the keys' differences their precision, and a V offset multiplies P's rounding; smoothed, the error is
    e4m3's on zero-mean inputs (~5 %). V's offset is judged on the output less V's mean, the part attention makes."""
    q, k, v = qkv((1, 2, 600, 128), seed=1, k_offset=6.0)
    v_offset = 4.0 * torch.randn((1, 2, 1, 128), generator=torch.Generator().manual_seed(2))

    def cast(t):
        scale = t.abs().amax(dim=(-2, -1), keepdim=True) / 448
        return ref.to_e4m3(t / scale) * scale

    def errors(v):
        exact = ref.exact_attention(q, k, v)
        made = exact - v.mean(dim=-2, keepdim=True)
        return [(out - exact).norm() / made.norm() for out in
                (ref.smoothed_fp8_attention(q, k, v), ref.e4m3_p_attention(cast(q), cast(k), cast(v)))]

    for smoothed, unsmoothed in (errors(v), errors(v + v_offset)):
        assert smoothed < 0.08 < 0.15 < unsmoothed, (smoothed, unsmoothed)
    q8, k8, v8, v_mean = ref.smoothed_e4m3(q, k, v + v_offset)
    assert torch.allclose(v_mean, (v + v_offset).mean(dim=-2, keepdim=True)) and k8.mean(dim=-2).abs().max() < 0.05


@pytest.mark.parametrize("pv, bound", [("fp16", 0.015), ("fp8", 0.06)])
def test_scheme_error_on_random_inputs(pv, bound):
    """The figures triton8.py's docstring gives: ~1 % with fp16 P·V, ~4 % with e4m3 P·V, on N(0, 1) inputs."""
    q, k, v = qkv((1, 2, 1024, 128))
    err = ref.relative_error(ref.quantized_attention(q, k, v, pv=pv), ref.exact_attention(q, k, v))
    assert 0.002 < err < bound


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from overdrive.attention import reference as ref, triton8
    torch.manual_seed(0)
    # Token counts off the block sizes (masked last key block, padded queries), cross-attention lengths, both head dims.
    for (b, h, nq, nkv, d) in [(1, 2, 200, 200, 64), (2, 1, 130, 77, 128)]:
        q, v = torch.randn(b, h, nq, d), torch.randn(b, h, nkv, d)
        k = torch.randn(b, h, nkv, d) + 3.0
        for block_n in (64, 128):
            out = triton8.attention(q, k, v, pv="fp16", config=(64, block_n, 4, 2))
            assert out.shape == (b, nq, h, d)
            scheme = ref.quantized_attention(q, k, v, block_n=block_n, pv="fp16").transpose(1, 2)
            err = ref.relative_error(out, scheme)
            assert err < 2e-3, (b, h, nq, nkv, d, block_n, err)
    # A (batch, tokens, heads*dim) layout viewed as (batch, heads, tokens, dim), as ComfyUI passes it.
    x = torch.randn(1, 150, 2 * 64)
    view = x.view(1, 150, 2, 64).transpose(1, 2)
    out = triton8.attention(view, view, view, pv="fp16", config=(64, 64, 4, 2))
    err = ref.relative_error(out, ref.exact_attention(view, view, view).transpose(1, 2))
    assert err < 0.02, err
    # cuDNN's fp8 backend: the kernels around its graph (one descale per tensor; output back to (b, tokens, h, d)).
    from overdrive.attention import cudnn8
    q, k, v = view * 3, torch.randn(1, 2, 90, 64), torch.randn(1, 2, 90, 64) * 0.1
    q8, k8, v8, scales = cudnn8.quantize(q, k, v)
    descales = [t.abs().amax() / 448 for t in (q, k, v)]
    torch.testing.assert_close(scales, torch.stack([*descales, 1 / descales[2]]))
    for x, x8, d in zip((q, k, v), (q8, k8, v8), descales):
        assert x8.shape == x.shape and x8.is_contiguous()
        # the interpreter's own fp8 cast loses the carry at powers of two: most elements equal torch's cast
        assert (x8.float() == (x / d).to(torch.float8_e4m3fn).float()).float().mean() > 0.9
    out = cudnn8.dequantize_output(q8, scales, torch.float16)
    torch.testing.assert_close(out, (q8.float() * descales[2]).transpose(1, 2).half())
    # Scales carried between calls on one set of buffers: kept while they fit, recast where they clip or waste range.
    casts = cudnn8._Casts(q.shape, k.shape, q.device)
    amaxes = torch.stack([t.abs().amax() for t in (q, k, v)])
    _, _, _, scales = cudnn8.quantize(q, k, v, casts)
    torch.testing.assert_close(scales[:3], amaxes / 448)  # nothing carried yet: each tensor's own scale
    cudnn8.dequantize_output(casts.v8, scales, torch.float16, casts)
    torch.testing.assert_close(casts.carried, amaxes)
    assert casts.amax.abs().sum() == 0
    grown, shrunk, clipping = q * 1.5, k * 0.3, v * 20  # within headroom / within the window / beyond the headroom
    q8, k8, v8, scales = cudnn8.quantize(grown, shrunk, clipping, casts)
    expected = torch.stack([amaxes[0] * cudnn8.HEADROOM, amaxes[1] * cudnn8.HEADROOM, amaxes[2] * 20]) / 448
    torch.testing.assert_close(scales[:3], expected)
    torch.testing.assert_close(scales[3], 1 / expected[2])
    for x, x8, d in zip((grown, shrunk, clipping), (q8, k8, v8), expected):
        assert (x8.float() == (x / d).to(torch.float8_e4m3fn).float()).float().mean() > 0.9
        assert x8.float().abs().max() <= 448
    cudnn8.dequantize_output(v8, scales, torch.float16, casts)
    torch.testing.assert_close(casts.carried, torch.stack([amaxes[0], amaxes[1], amaxes[2] * 20]))
    _, _, _, scales = cudnn8.quantize(q, k * 0.1, v * 20, casts)  # K now wastes more than the window: recast
    torch.testing.assert_close(scales[1], amaxes[1] * 0.1 / 448)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_matches_the_scheme_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_config_errors_name_the_setting():
    with pytest.raises(AttentionConfigError, match="attention mode 'fast' is not one of auto, exact, sdpa, 8bit"):
        AttentionConfig("fast")
    with pytest.raises(AttentionConfigError, match="attention_max_error must be in"):
        AttentionConfig("auto", 0.0)


def test_pick_takes_the_fastest_backend_within_the_bound():
    measured = [Measurement("int8_fp8", ms=0.30, rel_err=0.04), Measurement("int8_fp16", ms=0.36, rel_err=0.01),
                Measurement("cudnn_fp8", failed="not installed")]
    assert pick(measured, 0.40, AttentionConfig("auto", 0.05)) == "int8_fp8"
    assert pick(measured, 0.40, AttentionConfig("auto", 0.03)) == "int8_fp16"
    assert pick(measured, 0.37, AttentionConfig("auto", 0.03)) == "sdpa"      # not 3 % faster than SDPA
    assert pick(measured, 0.37, AttentionConfig("8bit", 0.03)) == "int8_fp16"  # 8bit: within the bound is enough
    assert pick(measured, 0.40, AttentionConfig("auto", 0.005)) == "sdpa"
    assert pick(measured, 0.40, AttentionConfig("sdpa")) == "sdpa"


def test_exact_mode_takes_only_16_bit_kernels_and_holds_them_to_rounding():
    measured = [Measurement("int8_fp8", ms=0.20, rel_err=0.01), Measurement("sdpa_cudnn", ms=0.33, rel_err=0.003),
                Measurement("fa3_bf16", ms=0.30, rel_err=0.003)]
    assert pick(measured, 0.40, AttentionConfig("exact")) == "fa3_bf16"   # the 8-bit kernel is faster: not exact
    assert pick(measured, 0.40, AttentionConfig("auto")) == "int8_fp8"
    assert pick(measured, 0.40, AttentionConfig("8bit")) == "int8_fp8"
    assert pick(measured, 0.305, AttentionConfig("exact")) == "sdpa"      # not 3 % faster than SDPA
    broken = [Measurement("fa3_bf16", ms=0.30, rel_err=0.02)]             # a 16-bit kernel off by more than rounding
    assert pick(broken, 0.40, AttentionConfig("auto", 0.05)) == "sdpa"
    assert considered(AttentionConfig("exact")) == ["sdpa_cudnn", "fa3_bf16"]
    assert considered(AttentionConfig("sdpa")) == []


def test_custom_op_runs_sdpa_off_the_gpu_and_compiles_with_its_fake():
    q, k, v = qkv((2, 3, 50, 64))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)

    def f(q, k, v):
        return torch.ops.overdrive.attention(q * 1.0, k, v, "auto", 0.03).reshape(2, 50, -1)

    torch.testing.assert_close(f(q, k, v), expected.reshape(2, 50, -1))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), expected.reshape(2, 50, -1))


def test_a_backend_that_runs_out_of_memory_is_kept_and_one_that_fails_otherwise_gives_way_to_sdpa(monkeypatch):
    """The op's fallback: out of memory is the card's state at that call, so SDPA runs that call and the chosen backend
    stays for the next; any other failure hands the shape to SDPA for good. (Real backends need a GPU: stand-ins that
    raise as a backend would.)"""
    from overdrive.attention.choice import BACKENDS, CHOOSER, Backend
    q, k, v = qkv((1, 2, 40, 64))
    config = AttentionConfig("auto", 0.05)
    key = CHOOSER._key(q, k, config)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    for error, kept in ((torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 276.00 MiB."), True),
                        (RuntimeError("an unsupported layout"), False)):
        def fail(q, k, v, error=error):
            raise error
        monkeypatch.setitem(BACKENDS, "stand_in", Backend(lambda q, k, v: None, fail, exact=True))
        monkeypatch.setitem(CHOOSER.choices, key, "stand_in")
        torch.testing.assert_close(torch.ops.overdrive.attention(q, k, v, "auto", 0.05), expected)
        assert (CHOOSER.choices[key] == "stand_in") is kept


@pytest.fixture()
def chosen_cudnn_fp8():
    """The chooser's record that cuDNN's fp8 graph won at a shape (the CPU cannot measure it), removed after."""
    from overdrive.attention.choice import CHOOSER
    keys = []

    def choose(q, k, config, batch=None):
        shape_q = (batch or q.shape[0], *q.shape[1:])
        shape_k = (batch or k.shape[0], *k.shape[1:])
        keys.append((shape_q, shape_k, str(q.dtype), str(q.device), config))
        CHOOSER.choices[keys[-1]] = "cudnn_fp8"
    yield choose
    for key in keys:
        CHOOSER.choices.pop(key, None)


def test_a_block_traced_where_cudnn_fp8_was_chosen_dequantizes_its_e4m3_output_in_the_graph(chosen_cudnn_fp8):
    """A block traced at a shape the chooser gave to cuDNN's fp8 graph calls `overdrive::attention_e4m3` (here SDPA's
    output cast to e4m3, off the GPU) and multiplies by its descale in the compiled code, which Inductor fuses into
    the kernel reading the output (no 16-bit copy of it is written); any other shape, the setting off and eager code
    keep the run-time op."""
    from overdrive.attention import op
    config = AttentionConfig("auto", 0.05)

    def block(x):
        q = torch.nn.functional.rms_norm(x, (64,))
        out = op.attend(q, q.flip(2) + 0.5, x * 2, config).reshape(x.shape[0], x.shape[2], -1)
        # two readers, as in Qwen-Image's blocks: the text stream's 16-bit input, the image stream's fp8 input cast
        return out[:, :8] * 3, (out[:, 8:] * 4).clamp(-448, 448).to(torch.float8_e4m3fn)

    x = torch.randn(1, 4, 300, 64, dtype=torch.bfloat16)
    exact = block(x)  # eager: the op, SDPA off the GPU
    chosen_cudnn_fp8(x, x, config, batch=2)  # measured at another batch (calibration's CFG): stands in
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def compiled(fn, x, **options):
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, **options)(x)

    def error(out):
        return max(ref.relative_error(a.float(), b.float()) for a, b in zip(out, exact))  # e4m3: a step may differ

    out = compiled(block, x, backend=backend)
    calls = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert any("attention_e4m3" in c for c in calls) and not any("overdrive.attention." in c for c in calls), calls
    assert 0.002 < error(out) < 0.05, error(out)  # the output's e4m3 rounding (~2.5 %), no more
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    fused, (code, *_) = run_and_get_code(torch.compile(block, fullgraph=True), x)
    assert error(fused) < 0.05
    # The readers' kernels read the e4m3 output: the only 16-bit buffers are Q, K, V and the text stream's input.
    bf16 = re.findall(r"empty_strided_cpu\(\(([\d, ]+)\),[^\n]*torch.bfloat16\)", code)
    assert sorted(bf16) == ["1, 4, 300, 64"] * 3 + ["1, 8, 256"] and "# reuse" not in code, code
    if hasattr(torch._dynamo.config, "enable_aot_compile"):  # as compiler/precompiled.py builds and saves a frame
        torch._dynamo.reset()
        with torch._dynamo.config.patch(enable_aot_compile=True):
            frame = torch.compile(block, fullgraph=True).aot_compile(((x,), {}))
        assert type(frame).serialize(frame).serialized_data
        assert error(frame(x)) < 0.05

    def keeps_the_op(x, **options):
        graphs.clear()
        compiled(block, x, backend=backend, **options)
        return not any("attention_e4m3" in str(n.target) for n in graphs[0].graph.nodes)

    assert keeps_the_op(torch.randn(1, 4, 200, 64, dtype=torch.bfloat16))  # a shape never measured
    # Shape-generic traces compare their sizes (a guard), never fail: the op at a shape never measured, the path at one.
    assert keeps_the_op(torch.randn(1, 4, 200, 64, dtype=torch.bfloat16), dynamic=True)
    assert not keeps_the_op(x, dynamic=True)
    config = AttentionConfig("auto", 0.05, e4m3_output=False)  # off: the op (block reads `config` when traced)
    chosen_cudnn_fp8(x, x, config)
    assert keeps_the_op(x)
    torch._dynamo.reset()


@pytest.fixture()
def comfy_attention(comfy):
    from overdrive.comfy_host.attention_override import OverdriveAttention, install_attention
    return OverdriveAttention, install_attention


def test_override_falls_back_to_comfyuis_function_exactly(comfy_attention):
    OverdriveAttention, _ = comfy_attention
    override = OverdriveAttention(AttentionConfig())
    calls = []

    def func(q, k, v, heads, **kwargs):
        calls.append(kwargs)
        return q * 2

    q = torch.randn(1, 16, 128)
    mask = torch.zeros(1, 16, 16)
    assert torch.equal(override(func, q, q, q, 2), q * 2)  # on the CPU
    assert torch.equal(override(func, q, q, q, 2, mask=mask), q * 2)  # a mask
    assert calls[1]["mask"] is mask and calls[0]["skip_reshape"] is False


def test_override_is_one_object_per_settings_and_survives_model_clones(comfy_attention):
    OverdriveAttention, _ = comfy_attention
    a = OverdriveAttention(AttentionConfig("auto", 0.03))
    assert OverdriveAttention(AttentionConfig("auto", 0.03)) is a is copy.deepcopy(a)
    assert OverdriveAttention(AttentionConfig("auto", 0.05)) is not a


def test_install_keeps_another_nodes_override_and_sdpa_removes_its_own(comfy, comfy_attention):
    from overdrive.harness.inprocess import build_model
    OverdriveAttention, install_attention = comfy_attention
    patcher = build_model(comfy, "sd15", "tiny", torch.float32, seed=0).clone()
    assert "auto" in install_attention(patcher, AttentionConfig())
    clone = patcher.clone()
    assert clone.model_options["transformer_options"][ATTENTION_OVERRIDE] is OverdriveAttention(AttentionConfig())
    assert "off" in install_attention(clone, AttentionConfig("sdpa"))
    assert ATTENTION_OVERRIDE not in clone.model_options["transformer_options"]
    foreign = patcher.clone()
    foreign.model_options["transformer_options"][ATTENTION_OVERRIDE] = lambda func, *a, **kw: func(*a, **kw)
    assert "another node" in install_attention(foreign, AttentionConfig())
    # Compile Model's `exact` keeps what Quantize Model set (its `auto` times the same 16-bit kernels) and leaves a
    # foreign override alone; on a model without one it installs its own.
    assert "auto, as set before" in install_attention(patcher, AttentionConfig("exact"))
    assert patcher.model_options["transformer_options"][ATTENTION_OVERRIDE].config.mode == "auto"
    assert "another node" in install_attention(foreign, AttentionConfig("exact"))
    assert "16-bit kernels" in install_attention(clone, AttentionConfig("exact"))
    assert clone.model_options["transformer_options"][ATTENTION_OVERRIDE].config.mode == "exact"


def test_compiled_blocks_get_overdrives_override_alone(comfy_attention):
    from overdrive.comfy_host.comfy_call_options import shared_block_options as block_transformer_options
    OverdriveAttention, _ = comfy_attention
    own = OverdriveAttention(AttentionConfig())
    assert block_transformer_options({"block_index": 3}) == {}
    assert block_transformer_options({ATTENTION_OVERRIDE: own, "block_index": 3}) == {ATTENTION_OVERRIDE: own}
    assert block_transformer_options({ATTENTION_OVERRIDE: lambda *a, **k: None}) is None
    assert block_transformer_options({ATTENTION_OVERRIDE: own, "patches": {"attn1_patch": [print]}}) is None


def test_a_block_call_carrying_overdrives_override_can_be_precompiled_keyed_by_its_settings(comfy_attention):
    """The override's settings are baked into a traced block: a saved frame is keyed by all of them, while another
    node's override (a function) leaves the call to torch.compile."""
    from overdrive.compiler.precompiled import call_signature
    OverdriveAttention, _ = comfy_attention

    def signature(override):
        return call_signature("forward", (torch.zeros(2, 3),), {"transformer_options": {ATTENTION_OVERRIDE: override}})
    auto = signature(OverdriveAttention(AttentionConfig("auto", 0.03)))
    assert auto is not None and auto == signature(OverdriveAttention(AttentionConfig("auto", 0.03)))
    assert auto != signature(OverdriveAttention(AttentionConfig("auto", 0.05)))
    assert auto != signature(OverdriveAttention(AttentionConfig("8bit", 0.03)))
    assert signature(lambda func, *a, **k: func(*a, **k)) is None

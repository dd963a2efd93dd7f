"""The quantization core on plain torch modules (CPU, real torch._int_mm / torch._scaled_mm kernels), no ComfyUI."""
import importlib.util
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import overdrive.quantization as oq
from overdrive.quantization import (Calibrator, Fp8Linear, Int8Linear, QuantCache, QuantConfig, QuantConv2d1x1,
                                    QuantReport, apply_modules, plan_quantization, quantize_module)
from overdrive.quantization import calibrate as calibrate_mod
from overdrive.quantization.formats import base as formats_mod
from overdrive.quantization import kernels

ALL = dict(linear_mse_threshold=1e9, conv_mse_threshold=1e9, compute_density_threshold=0)
QUANTIZABLE = {"proj_in", "block.ff1", "block.ff2", "block.attn_out", "temb", "proj_out"}  # linears + 1x1 convs
REL_TOL = 5e-2      # ||y_q - y|| / ||y|| of the whole int8 model (6 quantized layers) on fresh inputs
REL_TOL_FP8 = 8e-2  # fp8 e4m3 keeps 3 mantissa bits: ~3.5 % per layer, compounded over 6 layers


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.ff1 = nn.Linear(c, 2 * c)
        self.ff2 = nn.Linear(2 * c, c)
        self.attn_out = nn.Linear(c, c, bias=False)

    def forward(self, x):
        h = self.ff2(F.gelu(self.ff1(self.norm(x))))
        return x + h + self.attn_out(h)


class TinyUNetish(nn.Module):
    """Real layer types of a diffusion UNet at small sizes where the kernels apply (K, N >= 64, M >= 32)."""

    def __init__(self, c=64):
        super().__init__()
        self.conv_in = nn.Conv2d(4, c, 3, padding=1)
        self.temb = nn.Linear(c, c)                   # M = batch (2): padded to 17 rows for _int_mm
        self.proj_in = nn.Conv2d(c, c, 1)
        self.block = Block(c)
        self.proj_out = nn.Conv2d(c, 2 * c, 1)
        self.odd = nn.Linear(2 * c, 36)               # N = 36: not a multiple of 8/16, no kernel
        self.conv_out = nn.Conv2d(2 * c, 4, 3, padding=1)

    def forward(self, x, t):
        h = self.conv_in(x)
        h = self.proj_in(h) + self.temb(t)[:, :, None, None]
        b, c, hh, ww = h.shape
        r = self.block(h.permute(0, 2, 3, 1).reshape(b, hh * ww, c))
        h = self.proj_out(r.reshape(b, hh, ww, c).permute(0, 3, 1, 2))
        return self.conv_out(h) + self.odd(h.mean(dim=(2, 3)))[:, :4, None, None]


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyUNetish().eval().requires_grad_(False)


def inputs(seed, batch=2, size=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, size, size, generator=g), torch.randn(batch, 64, generator=g)


def calibration_for(model, steps=3):
    def run():
        for step in range(steps):
            model(*inputs(100 + step))
    return run


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------- config
def test_config_errors_name_problem_and_fix():
    with pytest.raises(ValueError, match=r"bits=5 .*4 or 8 bits.*Use bits=8"):
        QuantConfig(bits=5)
    with pytest.raises(ValueError, match=r"'int4_fp8' is a 4-bit format, but bits=8. Use bits=4"):
        QuantConfig(format="int4_fp8")
    with pytest.raises(ValueError, match=r"no 4-bit path.*int4_fp8 needs .*8.9.*or use bits=8"):
        QuantConfig(bits=4).resolve_format("cpu")
    with pytest.raises(ValueError, match=r"format='int4' is unknown.*'int8'"):
        QuantConfig(format="int4")
    with pytest.raises(ValueError, match=r"linear_mse_threshold=-1.*negative.*0 or more"):
        QuantConfig(linear_mse_threshold=-1)
    with pytest.raises(ValueError, match=r"compute_density_threshold"):
        QuantConfig(compute_density_threshold=-0.5)
    with pytest.raises(ValueError, match=r"min_speedup=-1.*negative"):
        QuantConfig(min_speedup=-1)
    with pytest.raises(ValueError, match=r"calibration_tokens"):
        QuantConfig(calibration_tokens=0)
    with pytest.raises(ValueError, match=r"no setting"):
        QuantConfig.from_dict({"bits": 8, "threshold": 1})
    assert QuantConfig().resolve_format("cpu") == "int8"


def test_fp8_on_a_device_without_fp8_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"fp8_e4m3.*compute capability 8.9.*Leave quantization off"):
        QuantConfig(format="fp8_e4m3").resolve_format("meta")
    # A GPU older than Ada (capability 8.6): no fp8, auto falls back to int8.
    monkeypatch.setattr(formats_mod, "cuda_capability", lambda device: (8, 6))
    monkeypatch.setattr(formats_mod, "_probed", lambda name, device: True)
    with pytest.raises(ValueError, match=r"fp8_e4m3.*8.9.*format='int8'"):
        QuantConfig(format="fp8_e4m3").resolve_format("cuda")
    assert QuantConfig().resolve_format("cuda") == "int8"
    monkeypatch.setattr(formats_mod, "cuda_capability", lambda device: (9, 0))
    assert QuantConfig().resolve_format("cuda") == "fp8_e4m3"


class _Int8TensorwiseLinear(oq.modules.QuantizedGemm):
    """A format written as a plug-in would be: int8 with one scale per tensor, through a plain float matmul."""
    format = "int8_tensorwise_test"
    per_channel_scales = False

    def quantize_weight(self, weight):
        scale = weight.float().abs().amax().clamp(min=1e-12) / 127
        return torch.round(weight.float() / scale).clamp(-127, 127).to(torch.int8), scale.reshape(1, 1)

    def gemm(self, x2d, out_dtype):
        bias = None if self.bias is None else self.bias
        return F.linear(x2d.float(), self.weight_q.float() * self.weight_scale, bias).to(out_dtype)

    reference_gemm = gemm


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_every_layer_kind_has_a_timed_call(fmt):
    """speed.py times what each format says a layer costs under compile; a 1x1 conv's wrapper included (a missing
    attribute there kept SDXL's fp8 skip connections in float on the GPU)."""
    if not formats_mod.get(fmt).supported("cpu"):
        pytest.skip(f"{fmt} matmul is not available on this CPU build")
    config = QuantConfig()
    torch.manual_seed(0)
    linear, conv = nn.Linear(32, 32), nn.Conv2d(32, 32, 1)
    for module, x in ((linear, torch.randn(4, 32)), (conv, torch.randn(1, 32, 4, 4))):
        layer = oq.quantized_module_for(module, fmt, config, input_amax=x.abs().amax())
        out = formats_mod.get(fmt).compiled_call(layer, x)()
        assert out.shape[-1] == 32 or out.shape[1] == 32


def test_a_format_registered_from_outside_runs_through_the_whole_pipeline(tmp_path):
    """Adding a format is its file and one `register`: config, candidates, calibration, decisions, the module swap
    and the cache take it with no other change."""
    formats_mod.register(formats_mod.QuantFormat("int8_tensorwise_test", _Int8TensorwiseLinear, kernel="F.linear",
                                                 k_multiple=8, probe=lambda device: None, auto_priority=-1))
    try:
        assert "int8_tensorwise_test" in oq.format_names()
        config = QuantConfig(**ALL, format="int8_tensorwise_test")
        model = make_model()
        x, t = inputs(5)
        expected = model(x, t)
        report = quantize_module(model, config, calibration=calibration_for(model), cache=tmp_path)
        assert report.format == "int8_tensorwise_test" and set(report.quantized) == QUANTIZABLE
        assert isinstance(model.block.ff1, _Int8TensorwiseLinear) and model.block.ff1.weight_scale.numel() == 1
        assert 0 < rel(model(x, t), expected) < REL_TOL
        again = make_model()
        assert quantize_module(again, config, calibration=None, cache=tmp_path).cache_hit
        torch.testing.assert_close(again(x, t), model(x, t))
        assert QuantConfig().resolve_format("cpu") == "int8"  # a lower auto priority leaves auto alone
    finally:
        formats_mod.REGISTRY.pop("int8_tensorwise_test")


# ----------------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("rows", [2, 16, 64])
def test_int8_linear_real_kernel_matches_dequantize_reference(rows):
    torch.manual_seed(1)
    linear = nn.Linear(96, 128)
    q = Int8Linear.from_float(linear)
    x = torch.randn(rows, 96) * 3
    y = q(x)                                    # torch._int_mm (rows < 17 are padded)
    ref = q.reference_forward(x)                # dequantize, then float64 matmul
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert rel(y, linear(x)) < 2e-2             # and it is close to the float layer


def test_fp8_linear_real_kernel_matches_dequantize_reference():
    if not oq.fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm has no CPU fp8 kernel in this build")
    torch.manual_seed(2)
    linear = nn.Linear(128, 64)
    q = Fp8Linear.from_float(linear)
    x = torch.randn(3, 40, 128)
    torch.testing.assert_close(q(x), q.reference_forward(x), rtol=2e-2, atol=2e-2)
    assert rel(q(x), linear(x)) < 6e-2


def test_fp8_static_activation_scale():
    """A static scale (from a calibration amax) runs the same GEMM as the dynamic one; inputs up to the headroom keep
    their precision, larger ones saturate at the fp8 maximum, as the reference does."""
    if not oq.fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm has no CPU fp8 kernel in this build")
    torch.manual_seed(4)
    linear = nn.Linear(128, 64)
    x = torch.randn(3, 40, 128)
    q = Fp8Linear.from_float(linear)
    assert not q.static_input
    dynamic = q(x)
    q.set_input_amax(x.abs().amax())
    assert q.static_input and "activation scale=static" in repr(q)
    assert q.input_scale.item() == pytest.approx(x.abs().amax().item() * kernels.STATIC_HEADROOM / kernels.FP8_MAX)
    assert torch.equal(q.input_scale_inverse, 1.0 / q.input_scale)  # the casts multiply by it
    assert "input_scale_inverse" not in q.state_dict()  # derived: caches and checkpoints hold the scale alone
    torch.testing.assert_close(q(x), q.reference_forward(x), rtol=2e-2, atol=2e-2)
    assert rel(q(x), linear(x)) < 6e-2 and rel(q(x), dynamic) < 6e-2
    grown = x * kernels.STATIC_HEADROOM * 0.99           # later steps' inputs, within the headroom: still exact-ish
    assert rel(q(grown), linear(grown)) < 6e-2
    outlier = x.clone()
    outlier[0, 0, 0] = x.abs().amax() * 10                # beyond the headroom: saturates, like the reference
    xq = kernels.quantize_tensor_fp8_static(outlier.reshape(-1, 128), q.input_scale_inverse)
    assert xq.float().abs().max().item() == kernels.FP8_MAX
    torch.testing.assert_close(q(outlier), q.reference_forward(outlier), rtol=2e-2, atol=2e-2)
    held = q.input_scale_inverse.data_ptr()  # a new scale is written in place, where compiled graphs read it
    q.set_input_amax(x.abs().amax() * 2)
    assert q.input_scale_inverse.data_ptr() == held and torch.equal(q.input_scale_inverse, 1.0 / q.input_scale)


TRITON_CHECK = textwrap.dedent("""
    import torch
    from overdrive.quantization import kernels, triton_kernels as tk
    torch.manual_seed(0)
    # int8: exact, including round-half-to-even ties (scale 1 when the row's amax is 127).
    x = torch.tensor([[0.5, 1.5, 2.5, -2.5, -0.5, 127.0] + [0.0] * 10])
    q, s = tk.quantize_rows_int8(x)
    assert q[0, :6].tolist() == [0, 2, 2, -2, 0, 127], q
    for m, k, dtype in [(5, 40, torch.float16), (3, 2500, torch.bfloat16), (33, 64, torch.float32)]:
        x = torch.randn(m, k).to(dtype) * 3
        q, s = tk.quantize_rows_int8(x)
        qr, sr = kernels.quantize_rows_int8(x)
        assert torch.equal(q, qr) and torch.equal(s, sr), (m, k, dtype)
    for m, k, dtype in [(5, 40, torch.float16), (70, 300, torch.bfloat16), (3, 5000, torch.float32)]:
        x = torch.randn(m, k).to(dtype) * 3
        q, s = tk.quantize_tensor_fp8(x)
        qr, sr = kernels.quantize_tensor_fp8(x)
        # the interpreter's fp8 cast loses the carry at powers of two: compare most elements and the scales
        assert torch.equal(s, sr) and (q.float() == qr.float()).float().mean() > 0.9, (m, k, dtype)
        static = tk.quantize_tensor_fp8_static(x, 1 / (sr * 2))
        assert (static.float() == kernels.quantize_tensor_fp8_static(x, 1 / (sr * 2)).float()).float().mean() > 0.9
    acc = torch.randint(-3000, 3000, (70, 90), dtype=torch.int32)
    xs, ws, b = torch.rand(70, 1) * 1e-2, torch.rand(1, 90) * 1e-2, torch.randn(90)
    for dtype in (torch.float16, torch.float32):
        assert torch.equal(tk.rescale(acc, xs, ws, b, dtype), (acc.float() * xs * ws + b).to(dtype))
        assert torch.equal(tk.rescale(acc, xs, ws, None, dtype), (acc.float() * xs * ws).to(dtype))
    # The weight-only kernel: fp16 rows times an int8 weight (ragged M, N and K, bias or not, one tile of rows or
    # several), against the float64 oracle.
    for m, n, k, with_bias, block_m in [(1, 200, 300, True, 16), (2, 64, 128, False, 16), (16, 70, 1000, True, 16),
                                        (40, 70, 300, True, 16), (33, 50, 200, False, 32)]:
        wq, wscale = kernels.quantize_weight_int8(torch.randn(n, k))
        bias = torch.randn(n) if with_bias else None
        x = torch.randn(m, k).half()
        y = tk.weight_only_matmul(x, wq, wscale, bias, torch.float32, config=(block_m, 64, 128, 4, 1))
        ref = kernels.reference_weight_only_linear(x, wq, wscale, bias, torch.float32)
        assert y.shape == (m, n) and ((y - ref).norm() / ref.norm()).item() < 1e-5, (m, n, k)
    # The whole eager int8 linear with the fused kernels equals the plain torch ops.
    w, bias = torch.randn(48, 64), torch.randn(48)
    wq, wscale = kernels.quantize_weight_int8(w)
    x = torch.randn(40, 64).half()
    plain = kernels.int8_linear(x, wq, wscale, bias, torch.float16)
    kernels._eager_triton = lambda t: True
    assert torch.equal(kernels.int8_linear(x, wq, wscale, bias, torch.float16), plain)
    # int4 codes to e4m3 weights (ragged sizes), most elements (the interpreter's fp8 cast, as above).
    for n, k in [(3, 256), (70, 384)]:
        packed, _, ratios = kernels.quantize_weight_int4(torch.randn(n, k))
        fused, plain = tk.dequantize_int4_fp8(packed, ratios).float(), kernels.dequantize_int4_fp8(packed, ratios).float()
        assert fused.shape == (n, k) and (fused == plain).float().mean() > 0.9, (n, k)
    print("ok")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_fused_triton_eager_kernels_match_torch_ops_in_the_interpreter():
    """The eager-CUDA Triton kernels, run on CPU by Triton's interpreter, against the torch ops they replace."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OVERDRIVE_QUANT_TRITON": "1"}
    out = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_quantized_modules_keep_dtype_and_reload_weights_in_place():
    torch.manual_seed(3)
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    q = Int8Linear.from_float(a).half()
    assert q.weight_q.dtype == torch.int8 and q.weight_scale.dtype == torch.float32
    ptr = q.weight_q.data_ptr()
    q.load_float_weight(b.weight, b.bias)
    assert q.weight_q.data_ptr() == ptr
    x = torch.randn(32, 64)
    assert rel(q(x.half()), b(x)) < 2e-2
    with pytest.raises(ValueError, match="does not fit"):
        q.load_float_weight(torch.randn(32, 64), b.bias)
    conv_a, conv_b = nn.Conv2d(64, 64, 1), nn.Conv2d(64, 64, 1)
    qc = QuantConv2d1x1.from_float(conv_a, "int8").load_float_weight(conv_b.weight, conv_b.bias)
    xc = torch.randn(2, 64, 4, 4)
    assert rel(qc(xc), conv_b(xc)) < 2e-2
    out_cl = qc(xc.contiguous(memory_format=torch.channels_last))
    assert out_cl.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------------------------- decisions
def test_threshold_zero_quantizes_nothing():
    model = make_model()
    before = state(model)
    report = quantize_module(model, QuantConfig(linear_mse_threshold=0, conv_mse_threshold=0, compute_density_threshold=0),
                       calibration=calibration_for(model))
    assert report.quantized == []
    assert all(isinstance(m, (nn.Linear, nn.Conv2d)) for n, m in model.named_modules() if n in QUANTIZABLE)
    assert {layer.name for layer in report.layers if layer.error is not None} == QUANTIZABLE
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_huge_threshold_quantizes_every_layer_a_kernel_can_run():
    model = make_model()
    x, t = inputs(7)
    reference = model(x, t)
    report = quantize_module(model, QuantConfig(**ALL), calibration=calibration_for(model))
    assert set(report.quantized) == QUANTIZABLE
    assert "no low-precision kernel for 3x3 conv" in report["conv_in"].reason
    assert "N=36 not a multiple of 8" in report["odd"].reason
    assert isinstance(model.block.ff1, Int8Linear) and isinstance(model.proj_in, QuantConv2d1x1)
    assert isinstance(model.conv_in, nn.Conv2d) and isinstance(model.odd, nn.Linear)
    assert rel(model(x, t), reference) < REL_TOL   # fresh inputs, not the calibration ones
    table = report.table()
    assert "block.ff1" in table and "quantize" in table and "SQNR" in table
    again = QuantReport.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()


def test_fp8_model_stays_close():
    if not oq.fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm has no CPU fp8 kernel in this build")
    model = make_model()
    x, t = inputs(8)
    reference = model(x, t)
    seen = []
    hook = model.block.ff1.register_forward_pre_hook(lambda m, args: seen.append(args[0].abs().amax()))
    report = quantize_module(model, QuantConfig(format="fp8_e4m3", **ALL), calibration=calibration_for(model))
    hook.remove()
    assert set(report.quantized) == QUANTIZABLE - {"odd"} and report.format == "fp8_e4m3"
    assert isinstance(model.block.ff1, Fp8Linear) and model.block.ff1.static_input
    # The static scale covers the largest input of all calibration calls, with the headroom.
    expected = max(seen) * kernels.STATIC_HEADROOM / kernels.FP8_MAX
    assert model.block.ff1.input_scale.item() == pytest.approx(expected.item(), rel=1e-6)
    assert model.proj_in.gemm.static_input
    assert rel(model(x, t), reference) < REL_TOL_FP8

    dynamic = make_model()
    quantize_module(dynamic, QuantConfig(format="fp8_e4m3", fp8_static_activations=False, **ALL),
              calibration=calibration_for(dynamic))
    assert not dynamic.block.ff1.static_input
    assert rel(dynamic(x, t), reference) < REL_TOL_FP8


@pytest.mark.parametrize("flag, left_alone", [("quantize_conv", {"proj_in", "proj_out"}),
                                               ("quantize_linear", {"temb", "block.ff1", "block.ff2",
                                                                    "block.attn_out"})])
def test_switches_leave_layers_alone(flag, left_alone):
    model = make_model()
    report = quantize_module(model, QuantConfig(**ALL, **{flag: False}), calibration=calibration_for(model))
    assert set(report.quantized) == QUANTIZABLE - left_alone
    for name in left_alone:
        assert type(model.get_submodule(name)) in (nn.Linear, nn.Conv2d)
        assert f"{flag}=False" in report[name].reason


def test_density_threshold_steers():
    model = make_model()
    plan = plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model))
    density = {layer.name: layer.density for layer in plan.report.layers if layer.name in QUANTIZABLE}
    assert density["temb"] < 5 < density["block.ff1"]        # M = 2 vs M = 128 rows
    cut = sorted(density.values())[3]
    plan = plan_quantization(model, QuantConfig(**{**ALL, "compute_density_threshold": cut, "weight_only": False}),
                             calibration=calibration_for(model))
    assert set(plan.report.quantized) == {n for n, d in density.items() if d >= cut}
    assert "memory-bound" in plan.report["temb"].reason


def test_memory_bound_layers_keep_their_weights_in_int8(tmp_path):
    """Below the density threshold a layer is not an 8-bit GEMM but stores its weight in int8 (one scale per output
    channel, half the bytes of fp16) where its measured error passes; the cache rebuilds the same layers."""
    from overdrive.quantization.modules import gemm_of
    from overdrive.quantization.weight_only import Int8WeightOnlyLinear

    model = make_model()
    density = {layer.name: layer.density
               for layer in plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model)).report.layers
               if layer.name in QUANTIZABLE}
    cut = sorted(density.values())[3]
    memory_bound = {n for n, d in density.items() if d < cut}
    config = QuantConfig(format="int8", compute_density_threshold=cut, linear_mse_threshold=1e-3,
                         conv_mse_threshold=1e-3)
    plan = plan_quantization(model, config, calibration=calibration_for(model))
    assert set(plan.report.weight_only) == memory_bound and "temb" in memory_bound
    for name in memory_bound:
        layer = plan.report[name]
        assert layer.quantized and layer.error < 1e-3 and layer.reason.startswith("weight-only int8")
        assert type(gemm_of(plan.modules[name])) is Int8WeightOnlyLinear
        assert gemm_of(plan.modules[name]).weight_q.dtype == torch.int8
    assert f"{len(memory_bound)} memory-bound layer(s) stored in int8" in plan.report.summary()
    first = plan_quantization(model, config, calibration=calibration_for(model), cache=tmp_path)
    again = plan_quantization(model, config, cache=tmp_path)
    assert again.report.cache_hit and set(again.report.weight_only) == memory_bound
    for name in memory_bound:
        assert torch.equal(gemm_of(again.modules[name]).weight_q, gemm_of(first.modules[name]).weight_q)
    x, t = inputs(5)
    expected = model(x, t)
    quantize_module(model, config, calibration=calibration_for(model))
    assert rel(model(x, t), expected) < REL_TOL

    # Too much error: the layer stays in float and the reason says both why.
    fresh = make_model()
    strict = plan_quantization(fresh, QuantConfig(**{**config.to_dict(), "linear_mse_threshold": 1e-12}),
                               calibration=calibration_for(fresh))
    assert not strict.report["temb"].quantized
    assert "memory-bound" in strict.report["temb"].reason and "weight-only int8 error" in strict.report["temb"].reason


def test_weight_only_compiled_call_is_one_reduction_that_matches_the_reference():
    """Under torch.compile a call with a few rows is one fused reduction over the int8 weight (no dequantized copy of
    the weight: Inductor's code reads weight_q once), with a per-call error against the float64 oracle of float32
    rounding; more rows take the dequantize-and-GEMM path."""
    from torch._inductor.utils import run_and_get_code

    from overdrive.quantization.weight_only import Int8WeightOnlyLinear

    torch.manual_seed(0)
    layer = Int8WeightOnlyLinear.from_float(nn.Linear(256, 512))
    for rows in (1, 2, kernels.WEIGHT_ONLY_REDUCTION_ROWS + 9):
        x = torch.randn(rows, 256)
        torch._dynamo.reset()
        y, code = run_and_get_code(torch.compile(layer, fullgraph=True), x)
        assert rel(y, layer.reference_forward(x)) < 1e-5
        fused = "extern_kernels.mm" not in "".join(code) and "addmm" not in "".join(code)
        assert fused == (rows <= kernels.WEIGHT_ONLY_REDUCTION_ROWS), rows


def test_filter_fn_and_error_threshold_between_layers():
    model = make_model()
    plan = plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model),
                             filter_fn=lambda module, name: not name.startswith("block."))
    assert set(plan.report.quantized) == QUANTIZABLE - {"block.ff1", "block.ff2", "block.attn_out"}
    assert plan.report["block.ff1"].reason == "excluded by filter_fn"
    errors = sorted(layer.error for layer in plan.report.layers if layer.error is not None)
    cut = (errors[1] + errors[2]) / 2
    plan = plan_quantization(model, QuantConfig(**{**ALL, "linear_mse_threshold": cut, "conv_mse_threshold": cut}),
                             calibration=calibration_for(model))
    assert {layer.name for layer in plan.report.layers if layer.quantized} == \
        {layer.name for layer in plan.report.layers if layer.error is not None and layer.error < cut}


def test_chosen_layers_wait_on_the_store_device_from_the_moment_they_are_decided():
    """ComfyUI passes its offload device: on a card that holds the float model only partly, the 8-bit layers must
    not pile up on it while the others are measured. The meta device stands for the host here."""
    from overdrive.quantization.gemm import QuantizedGemm
    from overdrive.quantization.modules import gemm_of
    import gc
    model = make_model()
    where = []

    def on_the_cpu() -> set:  # type(), not isinstance(): a dead weak proxy raises
        return {id(o) for o in gc.get_objects()
                if issubclass(type(o), QuantizedGemm) and o.weight_q.device.type == "cpu"}
    already = on_the_cpu()  # other tests' layers still alive in this process

    def before_each_layer():  # how many of this plan's quantized layers already sit on the measuring device
        where.append(len(on_the_cpu() - already))
    plan = plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model), store_device="meta",
                             between_layers=before_each_layer)
    assert set(plan.report.quantized) == QUANTIZABLE
    assert {gemm_of(m).weight_q.device.type for m in plan.modules.values()} == {"meta"}
    assert max(where) <= 1  # at most the layer measured last, not yet collected
    reference = plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model))
    assert [layer.error for layer in plan.report.layers] == [layer.error for layer in reference.report.layers]


def test_calibrator_keeps_a_bounded_sample_and_plan_does_not_mutate():
    model = make_model()
    before = {n: type(m) for n, m in model.named_modules()}
    config = QuantConfig(**ALL, calibration_tokens=48)
    with Calibrator(model, config) as cal:
        for step in range(5):
            model(*inputs(step, batch=2, size=16))   # 512 pixel rows per call
    assert not model.proj_in._forward_pre_hooks      # hooks removed on exit
    sample = cal.samples["proj_in"]
    assert sample.calls == 5 and sample.max_rows == 512 and sample.rows.shape == (48, 64)
    assert cal.samples["temb"].rows.shape == (10, 64)  # 5 calls x 2 rows
    plan = plan_quantization(model, config, calibration=cal)
    assert set(plan.modules) == QUANTIZABLE
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_a_stop_between_layers_ends_the_plan_with_the_model_unchanged():
    """The per-layer measurements (tens of seconds for a DiT on a GPU) check the host's stop before each layer: the
    stop ends the plan there and nothing is left half-applied."""
    class Stop(Exception):
        pass

    model = make_model()
    before = {n: type(m) for n, m in model.named_modules()}
    checks = []

    def stop_at_the_third_layer():
        checks.append(len(checks))
        if len(checks) == 3:
            raise Stop

    with pytest.raises(Stop):
        plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model),
                          between_layers=stop_at_the_third_layer)
    assert len(checks) == 3 and {n: type(m) for n, m in model.named_modules()} == before
    plan = plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model), between_layers=lambda: None)
    assert set(plan.modules) == QUANTIZABLE


def test_plan_made_in_inference_mode_can_be_reloaded_outside_it():
    """ComfyUI runs nodes under torch.inference_mode(); weight switching may happen elsewhere."""
    model = make_model()
    with torch.inference_mode():
        with Calibrator(model, QuantConfig(**ALL)) as cal:
            calibration_for(model)()
        plan = plan_quantization(model, QuantConfig(**ALL), calibration=cal)
    donor = make_model(seed=4)
    plan.modules["block.ff1"].load_float_weight(donor.block.ff1.weight, donor.block.ff1.bias)
    x = torch.randn(5, 64)
    assert rel(plan.modules["block.ff1"](x), donor.block.ff1(x)) < 2e-2


# ----------------------------------------------------------------------------------------------- all or nothing
def test_failures_leave_the_model_untouched(tmp_path):
    model = make_model()
    before = state(model)
    types = {n: type(m) for n, m in model.named_modules()}

    def broken():
        model(*inputs(0))
        raise RuntimeError("sampler crashed")

    with pytest.raises(RuntimeError, match="sampler crashed"):
        quantize_module(model, QuantConfig(**ALL), calibration=broken)
    with pytest.raises(ValueError, match="calibration is needed"):
        quantize_module(model, QuantConfig(**ALL), cache=tmp_path)
    with pytest.raises(ValueError, match="bits=7"):
        quantize_module(model, QuantConfig(bits=7), calibration=calibration_for(model))
    with pytest.raises(ValueError, match="no candidate layer was called"):
        quantize_module(model, QuantConfig(**ALL), calibration=lambda: None)
    assert {n: type(m) for n, m in model.named_modules()} == types
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    # A swap that fails half-way is rolled back.
    plan = plan_quantization(model, QuantConfig(**ALL), calibration=calibration_for(model))

    class Exploding(dict):
        def items(self):
            yield from list(plan.modules.items())[:2]
            raise RuntimeError("swap failed")

        def __iter__(self):
            return iter(plan.modules)

    with pytest.raises(RuntimeError, match="swap failed"):
        apply_modules(model, Exploding(plan.modules))
    assert {n: type(m) for n, m in model.named_modules()} == types
    with pytest.raises(KeyError):
        apply_modules(model, {"no.such.layer": Int8Linear(64, 64)})


# ----------------------------------------------------------------------------------------------- 4 bits
INT4 = dict(bits=4, format="int4_fp8")


def test_int4_weights_pack_two_codes_a_byte_with_group_scales():
    """Codes q + 8 in nibbles (even input channel low), a ratio per group of 128 to the largest group scale; the e4m3
    weight they make is q x ratio x 32, and its error on a normal weight is what 4 bits with groups allow."""
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    weight[3, 128:] *= 1e-3  # a quiet group keeps its own scale
    packed, scale, ratios = kernels.quantize_weight_int4(weight)
    assert packed.shape == (64, 128) and packed.dtype == torch.uint8 and ratios.shape == (64, 2)
    assert scale.shape == (1, 1) and ratios.dtype == torch.float16 and ratios.max() == 1
    codes = torch.stack((packed & 15, packed >> 4), -1).reshape(64, 256).float() - 8
    assert codes.min() >= -8 and codes.max() <= 7
    expected = (codes.reshape(64, 2, 128) * ratios.float()[..., None] * kernels.INT4_TO_FP8).reshape(64, 256)
    assert torch.equal(kernels.dequantize_int4_fp8(packed, ratios), expected.to(kernels.FP8_DTYPE))
    restored = kernels.dequantize_int4_fp8(packed, ratios).float() * scale
    assert oq.metrics.normalised_mse(restored, weight) < 0.013
    assert oq.metrics.normalised_mse(restored[3, 128:], weight[3, 128:]) < 0.02
    split = kernels.quantize_weight_int4(weight, rows_per_pass=256 * 5)  # a few rows a pass: the same result
    assert all(torch.equal(a, b) for a, b in zip(split, (packed, scale, ratios)))


def test_int4_linear_runs_its_reference_reloads_in_place_and_round_trips_its_state():
    torch.manual_seed(1)
    a, b = nn.Linear(256, 64), nn.Linear(256, 64)
    layer = oq.quantized_module_for(a, "int4_fp8", QuantConfig(**INT4), input_amax=torch.tensor(4.0))
    assert type(layer).__name__ == "Int4Linear" and layer.static_input and layer.weight_q.shape == (64, 128)
    x = torch.randn(32, 256)
    torch.testing.assert_close(layer(x), layer.reference_forward(x))
    assert 0 < rel(layer(x), a(x)) < 0.15
    pointer = layer.weight_q.data_ptr()
    layer.load_float_weight(b.weight, b.bias)
    assert layer.weight_q.data_ptr() == pointer and rel(layer(x), b(x)) < 0.15
    copy = oq.modules.build_empty("linear", "int4_fp8", 256, 64, True, QuantConfig(**INT4))
    copy.load_quantized_state(layer.quantized_state())
    assert torch.equal(copy(x), layer(x))
    with pytest.raises(ValueError, match="multiple of its group of 128"):
        oq.modules.build_empty("linear", "int4_fp8", 192, 64, True, QuantConfig(**INT4))
    with pytest.raises(ValueError, match="does not fit"):
        layer.load_float_weight(torch.randn(64, 128), b.bias)


class Wide(nn.Module):
    """Two layers 4 bits can take (K = 128, 256) and one it cannot (K = 64)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.narrow_in = nn.Linear(64, 128)
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.narrow_in(x))))


@pytest.mark.parametrize("store_weights", [False, True])
@pytest.mark.parametrize("threshold, in_4_bits", [(1.0, {"up", "down"}), (2e-3, set())])
def test_4_bits_where_the_error_passes_else_the_8_bit_decision_and_the_cache_keeps_both(tmp_path, threshold,
                                                                                       in_4_bits, store_weights):
    """A layer 4 bits cannot take (K = 64) or whose 4-bit error is too high gets the 8-bit format's decision (int8
    on the CPU); the report says which format each runs in, and the cache rebuilds the same layers (from the stored
    quantized tensors, group scales included, or quantized again)."""
    config = QuantConfig(**INT4, int4_mse_threshold=threshold, compute_density_threshold=0)
    model, x = Wide().eval().requires_grad_(False), torch.randn(64, 64)
    expected = model(x)
    cache = QuantCache(tmp_path, store_weights=store_weights)
    report = quantize_module(model, config, calibration=lambda: model(torch.randn(64, 64)), cache=cache)
    layer_formats = report.formats()
    assert {name for name, fmt in layer_formats.items() if fmt == "int4_fp8"} == in_4_bits
    assert {name for name, fmt in layer_formats.items() if fmt == "int8"} == {"narrow_in", "up", "down"} - in_4_bits
    assert "multiple of 128" in report["narrow_in"].reason
    if not in_4_bits:
        assert "int4_fp8 error" in report["up"].reason
    assert "of them in int8" in report.summary()
    assert rel(model(x), expected) < (0.2 if in_4_bits else 0.02)
    if store_weights and in_4_bits:
        from safetensors import safe_open
        with safe_open(str(tmp_path / f"{report.cache_key}.safetensors"), "pt") as stored:
            assert {"up.weight_q", "up.group_scale", "narrow_in.weight_q"} <= set(stored.keys())
    again = Wide().eval().requires_grad_(False)
    cached = quantize_module(again, config, calibration=None, cache=cache)
    assert cached.cache_hit and cached.formats() == layer_formats
    assert {name: type(m) for name, m in again.named_children()} == {name: type(m) for name, m in model.named_children()}
    torch.testing.assert_close(again(x), model(x))


# ----------------------------------------------------------------------------------------------- cache
@pytest.mark.parametrize("store_weights", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_cache_skips_calibration_on_the_second_run(tmp_path, monkeypatch, fmt, store_weights):
    """The decisions alone (the default) rebuild the same layers, static input scales included; with the weights
    stored, they are loaded instead."""
    if fmt == "fp8_e4m3" and not oq.fp8_supported("cpu"):
        pytest.skip("torch._scaled_mm has no CPU fp8 kernel in this build")
    measured = []
    real_measure = calibrate_mod.measure_layer
    monkeypatch.setattr(calibrate_mod, "measure_layer", lambda *a, **k: measured.append(1) or real_measure(*a, **k))
    runs = []
    threshold = 1e-2 if fmt == "int8" else 1e-1
    config = QuantConfig(**{**ALL, "linear_mse_threshold": threshold, "conv_mse_threshold": threshold,
                            "format": fmt})
    x, t = inputs(9)

    first = make_model()
    calibration = calibration_for(first)
    cache = QuantCache(tmp_path, store_weights=store_weights)
    report = quantize_module(first, config, calibration=lambda: runs.append(1) or calibration(), cache=cache,
                       resolution=(8, 8))
    assert report.calibrated and not report.cache_hit and measured and runs
    assert set(report.quantized) == QUANTIZABLE
    assert (tmp_path / f"{report.cache_key}.decisions").is_file()
    assert (tmp_path / f"{report.cache_key}.safetensors").is_file() == store_weights
    expected = first(x, t)

    measured.clear(), runs.clear()
    second = make_model()                            # same weights: same key
    report2 = quantize_module(second, config, calibration=lambda: runs.append(1), cache=cache, resolution=(8, 8))
    assert report2.cache_hit and not report2.calibrated and not measured and not runs
    assert report2.quantized == report.quantized and report2.cache_key == report.cache_key
    torch.testing.assert_close(second(x, t), expected)
    if fmt == "fp8_e4m3":  # the static activation scales come back from the cache
        assert second.block.ff1.static_input
        assert torch.equal(second.block.ff1.input_scale, first.block.ff1.input_scale)
        assert torch.equal(second.block.ff1.input_scale_inverse, first.block.ff1.input_scale_inverse)

    other = make_model(seed=1)                       # other weights: other key, calibrates
    report3 = quantize_module(other, config, calibration=calibration_for(other), cache=cache, resolution=(8, 8))
    assert report3.calibrated and report3.cache_key != report.cache_key
    third = make_model()                             # other resolution bucket: calibrates
    report4 = quantize_module(third, config, calibration=calibration_for(third), cache=cache, resolution=(64, 64))
    assert report4.calibrated and report4.cache_key != report.cache_key


def test_the_weights_digest_sees_one_changed_element_and_nothing_else():
    from overdrive.quantization.cache import tensor_hash, weights_digest
    model = make_model()
    digest = weights_digest(model)
    assert digest == weights_digest(make_model()) and digest != weights_digest(make_model(seed=1))
    with torch.no_grad():
        model.block.ff1.weight[3, 5] += 1e-3
    assert weights_digest(model) != digest
    values = torch.randn(3 * (1 << 22) + 5, generator=torch.Generator().manual_seed(0)).bfloat16()  # chunks + a tail
    values[0], values[1 << 22] = 1.0, 2.0
    swapped = values.clone()
    swapped[[0, 1 << 22]] = swapped[[1 << 22, 0]]  # the same elements, in other places
    assert tensor_hash(values) == tensor_hash(values.clone()) != tensor_hash(swapped)


def test_corrupt_cache_falls_back_to_calibration(tmp_path, caplog):
    config = QuantConfig(**ALL)
    model = make_model()
    cache = QuantCache(tmp_path, store_weights=True)
    key = quantize_module(model, config, calibration=calibration_for(model), cache=cache).cache_key
    decisions = tmp_path / f"{key}.decisions"

    # Edited decisions (checksum mismatch), then garbage: logged, ignored, re-calibrated; never a crash.
    data = decisions.read_bytes()
    assert b'"decision"' in data
    decisions.write_bytes(data.replace(b'"decision"', b'"decisiom"', 1))
    for content in (None, "{not json"):
        if content is not None:
            decisions.write_text(content)
        model = make_model()
        with caplog.at_level(logging.WARNING, logger="overdrive.quantization"):
            caplog.clear()
            report = quantize_module(model, config, calibration=calibration_for(model), cache=cache)
        assert report.calibrated and not report.cache_hit
        assert "corrupt cache file" in caplog.text and "calibrated and measured again" in caplog.text
        assert set(report.quantized) == QUANTIZABLE

    # Corrupt quantized weights: decisions still come from the cache, weights are re-quantized from float.
    weights = tmp_path / f"{key}.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10] + b"0123456789")
    model = make_model()
    with caplog.at_level(logging.WARNING, logger="overdrive.quantization"):
        caplog.clear()
        report = quantize_module(model, config, calibration=calibration_for(model), cache=cache)
    assert report.cache_hit and not report.calibrated and "corrupt cache file" in caplog.text
    assert "cached decisions stand" in caplog.text and "calibrated" not in caplog.text  # says what happens
    x, t = inputs(3)
    assert rel(model(x, t), make_model()(x, t)) < REL_TOL
    assert QuantCache(tmp_path).load("0" * 32) is None


# ----------------------------------------------------------------------------------------------- torch.compile
def test_quantized_model_compiles_without_graph_breaks_and_follows_new_weights():
    torch._dynamo.reset()
    model = make_model()
    quantize_module(model, QuantConfig(**ALL), calibration=calibration_for(model))
    compiles = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        compiles.append(gm)
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)   # fullgraph: a graph break would raise
    x, t = inputs(11)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t), model(x, t), rtol=1e-3, atol=1e-3)
        # Weight switching: re-quantize in place from another checkpoint's float weights, no recompile.
        donor = make_model(seed=5)
        for name in QUANTIZABLE:
            src = donor.get_submodule(name)
            model.get_submodule(name).load_float_weight(src.weight, src.bias)
        for name in ("conv_in", "odd", "conv_out", "block.norm"):
            model.get_submodule(name).load_state_dict(donor.get_submodule(name).state_dict())
        out = compiled(x, t)
        torch.testing.assert_close(out, model(x, t), rtol=1e-3, atol=1e-3)
        assert rel(out, donor(x, t)) < REL_TOL
    assert len(compiles) == 1
    torch._dynamo.reset()


def test_speed_is_not_timed_off_the_gpu():
    """The measured-speed rule (min_speedup) needs CUDA graphs; on the CPU density alone decides."""
    from overdrive.quantization.speed import measured_speedup
    layer = nn.Linear(64, 64)
    assert measured_speedup(layer, layer, (32, 64), torch.float32) is None


# ----------------------------------------------------------------------------------------------- LoRA side paths
def test_a_side_path_adds_its_low_rank_terms_at_their_slices_and_strengths_change_in_place():
    """Two terms on one layer (the second on a slice of its outputs, as a LoRA's q on a fused qkv), beside an int8
    layer: the output is the quantized layer's plus each term's, equal to the float layer with the terms merged to
    within int8's error; new strengths change the output without replacing any buffer (graphs that captured them see
    them)."""
    from overdrive.quantization.low_rank import LowRankSidePath, LowRankTerm, rank_bucket, side_path_reference
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    base = Int8Linear.from_float(layer)
    terms = [LowRankTerm(torch.randn(96, 4) * 0.1, torch.randn(4, 64) * 0.1, 0.8),
             LowRankTerm(torch.randn(32, 2) * 0.1, torch.randn(2, 64) * 0.1, 1.5, rows=(32, 32))]
    path = LowRankSidePath(base, rank_bucket(6), torch.float32)
    path.write(terms)
    x = torch.randn(5, 64)
    expected = x @ side_path_reference(layer.weight, terms).T + layer.bias
    assert rel(path(x), expected) < 0.02
    assert rel(path(x) - base(x), x @ (side_path_reference(layer.weight, terms) - layer.weight).T) < 1e-5
    buffers = [path.down.data_ptr(), path.up.data_ptr(), path.scale.data_ptr()]
    path.write_strengths([(4, 0.0), (2, 0.0)])
    assert torch.allclose(path(x), base(x)) and buffers == [path.down.data_ptr(), path.up.data_ptr(),
                                                            path.scale.data_ptr()]
    with pytest.raises(ValueError, match="do not fit"):
        path.write(terms * 6)


def test_a_switch_that_runs_out_of_memory_quantizing_on_the_card_quantizes_that_layer_where_it_is(monkeypatch):
    """Switch Weights quantizes the new file's weights on the card (requantize's `quantize_on`); a layer whose
    quantizing runs the card out of memory (a loaded model beside it) is quantized where the layer is instead, to the
    same tensors, and so is each later one that does: every layer once, in order, from its own weights. The meta device
    stands in for the card."""
    from overdrive.quantization import Int8Linear
    from overdrive.quantization.modules import requantize
    torch.manual_seed(0)
    layers = {name: Int8Linear.from_float(torch.nn.Linear(32, 16)) for name in ("a", "b", "c")}
    state = {f"{name}.{kind}": torch.randn(16, 32) if kind == "weight" else torch.randn(16)
             for name in layers for kind in ("weight", "bias")}
    quantize, on_host = Int8Linear.quantize_weight, []

    def full_card(self, tensor):
        if tensor.is_meta:
            raise torch.OutOfMemoryError("CUDA out of memory")
        on_host.append(tensor)
        return quantize(self, tensor)
    monkeypatch.setattr(Int8Linear, "quantize_weight", full_card)
    switched = requantize(layers, state, copy=True, quantize_on=torch.device("meta"))
    assert [t.data_ptr() for t in on_host] == [state[f"{name}.weight"].data_ptr() for name in layers]
    expected = requantize(layers, state, copy=True)
    assert list(switched) == list(layers) and all(switched[name] is not layers[name] for name in layers)
    for name in layers:
        assert all(torch.equal(a, b) for a, b in zip(switched[name].state_dict().values(),
                                                       expected[name].state_dict().values()))


def test_layers_whose_rows_are_on_another_device_are_measured_over_float_twins_there_in_order():
    """quantization/float_twins.py: a layer whose calibration rows sit on another device than its plain float weight
    (the card against dynamic VRAM's host weights; `meta` stands in here) is measured over a plain twin of its kind and
    geometry whose weights were copied there; a layer without rows, with a skip reason or whose rows are beside its
    weight is passed on as it is, in the same order."""
    from overdrive.quantization.calibrate import LayerSample
    from overdrive.quantization.candidates import Candidate
    from overdrive.quantization.float_twins import float_twin, measured_beside_rows
    linear, conv, beside, unrecorded = nn.Linear(8, 4), nn.Conv2d(4, 6, 1, bias=False), nn.Linear(8, 2), nn.Linear(8, 3)
    candidates = [Candidate("linear", linear, "linear", None, True), Candidate("beside", beside, "linear", None, True),
                  Candidate("conv", conv, "conv1x1", None, True),
                  Candidate("unrecorded", unrecorded, "linear", None, True),
                  Candidate("skipped", nn.Linear(8, 5), "linear", "no kernel", True)]
    on_meta = dict(rows=torch.empty(3, 8, device="meta"))
    samples = {"linear": LayerSample(**on_meta), "beside": LayerSample(rows=torch.ones(3, 8)),
               "conv": LayerSample(rows=torch.empty(3, 4, device="meta")), "skipped": LayerSample(**on_meta)}
    measured = list(measured_beside_rows(candidates, samples))
    assert [c.name for c in measured] == [c.name for c in candidates]
    assert [c is original for c, original in zip(measured, candidates)] == [False, True, False, True, True]
    for twin, original in ((measured[0].module, linear), (measured[2].module, conv)):
        assert isinstance(twin, type(original)) and twin.weight.is_meta
        assert twin.weight.shape == original.weight.shape and (twin.bias is None) == (original.bias is None)
        assert not twin.weight.requires_grad
    assert measured[2].module.kernel_size == (1, 1) and measured[2].in_features == 4

    # over the same tensors a twin computes what its layer does
    conv3 = nn.Conv2d(3, 5, 3, stride=2, padding=1)
    x = torch.randn(2, 3, 9, 9)
    assert torch.equal(float_twin(conv3, conv3.weight.detach(), conv3.bias.detach())(x), conv3(x))
    assert torch.equal(float_twin(linear, linear.weight.detach(), None)(x[..., :8, :8].reshape(-1, 8)),
                       F.linear(x[..., :8, :8].reshape(-1, 8), linear.weight))
    # a weight stored in another dtype than the layer's input (a bf16 file under fp16): the call runs in the input's
    rows, weight = torch.randn(5, 8), linear.weight.detach().to(torch.bfloat16)
    twin = float_twin(linear, weight, linear.bias.detach().to(torch.bfloat16))
    assert twin.weight.dtype == torch.bfloat16  # quantized and measured from the file's own values
    assert torch.equal(twin(rows), F.linear(rows, weight.float(), linear.bias.detach().to(torch.bfloat16).float()))


def test_weights_copied_ahead_off_the_card_are_each_layers_tensors_in_order():
    """core/weights_ahead.py off CUDA: each layer's tuple as `.to` gives it, None kept, in order, lazily."""
    from overdrive.core.weights_ahead import on_device_ahead
    layers = [(torch.ones(2), None), (torch.zeros(3), torch.ones(1)), (torch.full((4,), 2.0),)]
    arrived = on_device_ahead(layers, "meta")
    first = next(arrived)
    assert first[0].is_meta and first[0].shape == (2,) and first[1] is None
    rest = list(arrived)
    assert [[None if t is None else tuple(t.shape) for t in layer] for layer in rest] == [[(3,), (1,)], [(4,)]]
    assert list(on_device_ahead([], "cuda")) == []

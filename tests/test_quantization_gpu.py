"""Quantization on a real CUDA GPU: the measured-speed rule and the 8-bit kernels against the float layer.

Skipped without CUDA (CI has no GPU); run on the GPU machine with `python3 -m pytest tests/test_quantization_gpu.py`.
"""
import pytest
import torch
import torch.nn as nn

from overdrive.quantization import QuantConfig, plan_quantization

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ACCEPT_ANY_ERROR = dict(linear_mse_threshold=1e9, conv_mse_threshold=1e9, compute_density_threshold=0)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1280, 5120), nn.GELU(), nn.Linear(5120, 1280)).cuda().half()


def calibrate(model):
    with torch.no_grad():
        model(torch.randn(2, 4096, 1280, device="cuda", dtype=torch.half))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_speed_is_measured_and_steers_the_decision(fmt):
    model = mlp()
    if fmt == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    never = plan_quantization(model, QuantConfig(format=fmt, min_speedup=1000.0, **ACCEPT_ANY_ERROR),
                              calibration=calibrate)
    assert never.report.quantized == []
    for layer in never.report.layers:
        assert layer.speedup is not None and 0.05 < layer.speedup < 20, layer
        assert layer.reason.startswith("measured"), layer.reason
    always = plan_quantization(model, QuantConfig(format=fmt, min_speedup=0.0, **ACCEPT_ANY_ERROR),
                               calibration=calibrate)
    assert sorted(always.report.quantized) == ["0", "2"]
    assert all(layer.speedup is None for layer in always.report.layers)
    x = torch.randn(2, 4096, 1280, device="cuda", dtype=torch.half)
    with torch.no_grad():
        reference = model(x).float()
        y = always.modules["2"](model[1](always.modules["0"](x))).float()
    assert ((y - reference).norm() / reference.norm()).item() < 0.1



def test_static_fp8_scales_under_compile_match_eager_and_are_timed_as_compiled():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    from overdrive.quantization import apply_modules
    from overdrive.quantization.speed import compiled_cost

    model = mlp()
    x = torch.randn(2, 4096, 1280, device="cuda", dtype=torch.half)
    with torch.no_grad():
        reference = model(x).float()
    plan = plan_quantization(model, QuantConfig(format="fp8_e4m3", min_speedup=0.0, **ACCEPT_ANY_ERROR),
                             calibration=calibrate)
    assert sorted(plan.report.quantized) == ["0", "2"]
    assert all(module.static_input for module in plan.modules.values())
    # The speed rule times a static layer's GEMM on an already cast input (the cast fuses into the producer).
    layer = plan.modules["0"]
    cost = compiled_cost(layer, x)
    with torch.no_grad():
        torch.testing.assert_close(cost().float(), layer(x).reshape(-1, 5120).float(), rtol=0, atol=0)
    apply_modules(model, plan.modules)
    with torch.no_grad():
        eager = model(x).float()
        compiled = torch.compile(model)(x).float()
    assert ((eager - reference).norm() / reference.norm()).item() < 0.1
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-2


@pytest.mark.parametrize("rows", [1, 2, 16, 17, 128, 129])
def test_weight_only_layer_compiled_and_eager_match_the_reference(rows):
    """A weight-only int8 layer with a modulation's rows or a text stream's: the Triton kernel (compiled and eager code
    call it through its custom op) up to WEIGHT_ONLY_MAX_ROWS rows, the dequantizing GEMM above; both within rounding
    of the float64 oracle."""
    from torch._inductor.utils import run_and_get_code

    from overdrive.quantization.triton_kernels import WEIGHT_ONLY_MAX_ROWS
    from overdrive.quantization.weight_only import Int8WeightOnlyLinear

    torch.manual_seed(0)
    layer = Int8WeightOnlyLinear.from_float(nn.Linear(3072, 9216)).cuda().to(torch.bfloat16)
    x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
    ref = layer.reference_forward(x).float()
    torch._dynamo.reset()
    compiled, code = run_and_get_code(torch.compile(layer, fullgraph=True), x)
    for y in (layer(x), compiled):
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert ("weight_only_matmul" in "".join(code)) == (rows <= WEIGHT_ONLY_MAX_ROWS), rows


class MemoryBoundLayers(nn.Module):
    """A modulation linear (one row a call), a text stream's MLP projection (128 rows a call) and a final projection
    to a few channels over every image token: all below the density threshold, so all memory-bound; the last one's
    bytes are its input and output, not its weight."""

    def __init__(self):
        super().__init__()
        self.modulation = nn.Linear(3072, 18432)
        self.text = nn.Linear(3072, 12288)
        self.proj_out = nn.Linear(3072, 64)

    def forward(self, vec, text, image):
        return self.modulation(vec), self.text(text), self.proj_out(image)


def test_memory_bound_layer_takes_its_8bit_gemm_only_where_that_measures_faster():
    """A memory-bound layer with a text stream's rows, whose weight outweighs its input and output, is stored in int8
    and its fp8 GEMM timed against that storage at its input shape: the decision follows the measured ratio (whichever
    it is on this GPU), the report says which was faster, a `min_speedup` no GEMM reaches keeps it weight-only, and
    timing off (0) times nothing. The modulation (one row) and the final projection (its bytes are activations) stay
    weight-only untimed."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    torch.manual_seed(0)
    model = MemoryBoundLayers().cuda().to(torch.bfloat16)
    inputs = {"modulation": torch.randn(1, 1, 3072, device="cuda", dtype=torch.bfloat16),
              "text": torch.randn(1, 128, 3072, device="cuda", dtype=torch.bfloat16),
              "proj_out": torch.randn(1, 4096, 3072, device="cuda", dtype=torch.bfloat16)}

    def calibration(m):
        with torch.no_grad():
            m(*inputs.values())

    def plan(min_speedup):
        return plan_quantization(model, QuantConfig(format="fp8_e4m3", min_speedup=min_speedup), calibration=calibration)

    measured = plan(1.1)
    assert sorted(measured.report.quantized) == ["modulation", "proj_out", "text"]
    for layer in measured.report.layers:
        assert layer.density < 300, layer
        if layer.name in ("modulation", "proj_out"):
            assert layer.weight_only and layer.speedup is None and "GEMM" not in layer.reason.split("):")[1], layer
            continue
        assert layer.speedup is not None, layer
        ratio = float(layer.reason.split(" measured ")[1].split("x")[0])
        if layer.weight_only:
            assert ratio < 1.1 and f"its fp8_e4m3 GEMM measured {ratio:.2f}x its speed" in layer.reason, layer.reason
        else:
            assert ratio >= 1.1 and layer.reason.startswith("fp8_e4m3 GEMM (memory-bound"), layer.reason
            assert measured.modules[layer.name].format == "fp8_e4m3" and measured.modules[layer.name].static_input
    with torch.no_grad():
        for name, x in inputs.items():
            reference = getattr(model, name)(x).float()
            y = measured.modules[name](x).float()
            assert ((y - reference).norm() / reference.norm()).item() < 0.1, name
    never = plan(1000.0)
    assert sorted(never.report.weight_only) == ["modulation", "proj_out", "text"]
    assert [layer.name for layer in never.report.layers if "GEMM measured" in layer.reason] == ["text"]
    untimed = plan(0.0)
    assert sorted(untimed.report.weight_only) == ["modulation", "proj_out", "text"]
    assert all(layer.speedup is None for layer in untimed.report.layers)


def test_cublaslt_fp8_gemm_gelu_matches_the_separate_kernels_saturates_and_replays():
    """quantization/cublaslt.py: cuBLASLt's fp8 GEMM with its GELU epilogue writing e4m3, against torch's fp8 GEMM,
    tanh-GELU in float32 and the cast (the custom op's own fallback): no further from float32 than they are, clamped at
    448 (never NaN) when the output scale is too small, and the same from a CUDA graph's replay."""
    from overdrive.quantization import cublaslt, kernels
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    torch.manual_seed(0)
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    w, bias = torch.randn(4096, 1024, device="cuda") / 32, (torch.randn(4096, device="cuda") / 10).to(torch.bfloat16)
    wq, w_scale = kernels.quantize_weight_fp8(w)
    x_scale = kernels.static_fp8_scale(x.abs().amax())
    xq = kernels.quantize_tensor_fp8_static(x, 1 / x_scale)
    exact = torch.nn.functional.gelu(xq.float() @ wq.float().t() * (x_scale * w_scale) + bias.float(),
                                     approximate="tanh")
    out_scale = kernels.static_fp8_scale(exact.abs().amax())
    y = kernels.fp8_gemm(xq, x_scale, wq, w_scale, bias, torch.bfloat16)
    separate = kernels.quantize_tensor_fp8_static(torch.nn.functional.gelu(y.float(), approximate="tanh"),
                                                  1 / out_scale)
    fused = cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, 1 / out_scale)
    assert fused.dtype == torch.float8_e4m3fn and fused.shape == (1000, 4096)
    # Both against float32 from the same e4m3 operands: the e4m3 output's own rounding (~2.6 %, measured), no more.
    errors = [((out.float() * out_scale - exact).norm() / exact.norm()).item() for out in (fused, separate)]
    assert errors[0] < 1.02 * errors[1] and errors[0] < 3e-2, errors
    tight = cublaslt.fp8_gemm_gelu(xq, x_scale, wq, w_scale, bias, 8 / out_scale).float()
    assert not tight.isnan().any() and tight.abs().max().item() == 448.0
    static_x = xq.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = cublaslt.fp8_gemm_gelu(static_x, x_scale, wq, w_scale, bias, 1 / out_scale)
    static_x.copy_(xq.flip(0))
    graph.replay()
    assert torch.equal(graphed.float(), cublaslt.fp8_gemm_gelu(xq.flip(0).contiguous(), x_scale, wq, w_scale, bias,
                                                               1 / out_scale).float())


@pytest.mark.parametrize("rows", [1, 4608])
def test_int4_layer_eager_and_compiled_match_the_reference_and_save_half_the_bytes(rows):
    """int4 weights in fp8 GEMMs: the eager Triton pass that makes the e4m3 weight equals the torch ops Inductor
    compiles, and eager, compiled and the float64 oracle agree; the stored weight is half an 8-bit layer's."""
    from overdrive.quantization import kernels, triton_kernels
    from overdrive.quantization.formats.fp8 import Fp8Linear
    from overdrive.quantization.formats.int4 import Int4Linear

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9")
    torch.manual_seed(0)
    linear = nn.Linear(3072, 9216).cuda()
    x = torch.randn(rows, 3072, device="cuda", dtype=torch.bfloat16)
    layer = Int4Linear.from_float(linear).set_input_amax(x.abs().amax().float())
    assert torch.equal(triton_kernels.dequantize_int4_fp8(layer.weight_q, layer.group_scale).float(),
                       kernels.dequantize_int4_fp8(layer.weight_q, layer.group_scale).float())
    ref = layer.reference_forward(x).float()
    torch._dynamo.reset()
    for y in (layer(x), torch.compile(layer, fullgraph=True)(x)):
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    float_out = linear(x.float())
    assert ((layer(x).float() - float_out).norm() / float_out.norm()).item() < 0.15
    size = sum(t.numel() * t.element_size() for t in layer.quantized_state().values())
    eight_bit = sum(t.numel() * t.element_size() for t in Fp8Linear.from_float(linear).quantized_state().values())
    assert size < 0.55 * eight_bit

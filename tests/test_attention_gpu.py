"""8-bit attention on a real Hopper GPU: each backend against fp32 attention at a DiT and a UNet shape, and the
per-shape choice's timing with the host's launches hidden.

Skipped without a Hopper GPU (CI has none); run on the GPU machine with `python3 -m pytest tests/test_attention_gpu.py`.
"""
import pytest
import torch

from overdrive.attention import cudnn8, reference, triton8
from overdrive.attention.choice import _median_ms

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
                                reason="needs a Hopper GPU")


def inputs(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", generator=g, dtype=dtype) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("shape", [(1, 24, 4608, 128), (2, 10, 1000, 64)])
@pytest.mark.parametrize("backend", ["triton_fp8", "triton_fp16", "cudnn_fp8"])
def test_backend_matches_fp32_attention(shape, backend):
    q, k, v = inputs(shape)
    if backend == "cudnn_fp8":
        if cudnn8.supports(q, k, v) is not None:
            pytest.skip(cudnn8.supports(q, k, v))
        out, bound = cudnn8.attention(q, k, v), 0.10  # fp8 output, one scale per tensor (bench/EXPERIMENTS.md)
    else:
        pv = backend.split("_")[1]
        out, bound = triton8.attention(q, k, v, pv=pv), {"fp8": 0.05, "fp16": 0.02}[pv]
    assert out.shape == (shape[0], shape[2], shape[1], shape[3]) and out.dtype == q.dtype
    err = reference.relative_error(out.transpose(1, 2), reference.exact_attention(q, k, v))
    assert err < bound, err


def test_host_hidden_timing_is_the_gpu_time_of_a_launch_bound_call():
    """Many tiny launches: timed back to back they take the host's time; behind the sleep, their GPU time."""
    x = torch.zeros(16, device="cuda")

    def tiny():
        for _ in range(200):
            x.add_(1)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    tiny()
    end.record()
    end.synchronize()
    assert _median_ms(tiny) < start.elapsed_time(end)


def test_cudnn_fp8_reuses_its_operands_and_resets_their_maxima():
    """Calls on one stream share the fp8 buffers: a call after one with larger inputs gets its own scales."""
    q, k, v = inputs((1, 4, 1024, 128))
    if cudnn8.supports(q, k, v) is not None:
        pytest.skip(cudnn8.supports(q, k, v))
    small = [t * 0.01 for t in (q, k, v)]
    first = cudnn8.attention(*small)
    cudnn8.attention(q, k, v)
    assert torch.equal(cudnn8.attention(*small), first)
    operands = cudnn8._graph(q.shape, k.shape, 128 ** -0.5, q.device).operands_for(torch.cuda.current_stream())
    assert operands.amax.abs().sum().item() == 0


def test_cudnn_fp8_carried_scales_cost_no_accuracy():
    """The steady-state path (scales carried from the call before, up to WINDOW x the tensor's own) errs as little as
    a call at its own scales: e4m3 keeps its precision over that range."""
    q, k, v = inputs((1, 24, 4096, 128), seed=1)  # a shape of its own: its first call casts at the tensors' own scales
    if cudnn8.supports(q, k, v) is not None:
        pytest.skip(cudnn8.supports(q, k, v))
    exact = reference.exact_attention(q, k, v)
    own = reference.relative_error(cudnn8.attention(q, k, v).transpose(1, 2), exact)
    grown = 0.49 * cudnn8.WINDOW  # a call this much larger is recast and its scales carried ...
    cudnn8.attention(*(t * grown for t in (q, k, v)))
    out = cudnn8.attention(q, k, v)  # ... to this one: 0.98 x WINDOW its own, still kept
    operands = cudnn8._graph(q.shape, k.shape, 128 ** -0.5, q.device).operands_for(torch.cuda.current_stream())
    amaxes = torch.stack([t.abs().amax().float() for t in (q, k, v)])
    torch.testing.assert_close(operands.scales[:3], amaxes * grown * cudnn8.HEADROOM / 448, rtol=1e-2, atol=0)
    carried = reference.relative_error(out.transpose(1, 2), exact)
    assert carried < own * 1.15, (own, carried)


def test_cudnn_fp8_e4m3_output_under_inductor_and_cuda_graphs():
    """e4m3_output.py's path as a compiled block runs it: the backend's casts, cuDNN's graph writing e4m3
    tokens-major, the descale multiplied in the compiled code; recorded into a CUDA graph and replayed; as accurate as
    the backend's own 16-bit output, at every replay. The e4m3 output and descale are new tensors at each call (a
    later call leaves an earlier one's alone)."""
    from overdrive.attention import e4m3_output
    q, k, v = inputs((2, 24, 1024, 128), seed=2)
    if cudnn8.supports(q, k, v) is not None:
        pytest.skip(cudnn8.supports(q, k, v))
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # ComfyUI's (batch, tokens, ...)
    exact = reference.exact_attention(q, k, v).transpose(1, 2)
    out8, descale = cudnn8.attention_e4m3(q, k, v)
    kept = out8.clone(), descale.clone()
    cudnn8.attention_e4m3(*(t * 3 for t in (q, k, v)))
    assert torch.equal(out8.view(torch.uint8), kept[0].view(torch.uint8)) and torch.equal(descale, kept[1])
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: e4m3_output.attention(q * 1.0, k * 1.0, v * 1.0), fullgraph=True)
    out = compiled(q, k, v)
    err = reference.relative_error(out, exact)
    own = reference.relative_error(cudnn8.attention(q, k, v), exact)
    assert out.shape == exact.shape and out.dtype == q.dtype
    assert err < min(0.10, own * 1.05), (err, own)
    graph = torch.cuda.CUDAGraph()
    static = [t.clone() for t in (q, k, v)]
    compiled(*static)  # warm on the side stream, as the block graphs do
    with torch.cuda.graph(graph):
        replayed = compiled(*static)
    for scale in (1.0, 3.0):  # new inputs: the replay casts them at scales carried on its own stream
        for t, source in zip(static, (q, k, v)):
            t.copy_(source * scale)
        graph.replay()
        exact = reference.exact_attention(*static).transpose(1, 2)
        # Larger inputs make the softmax peakier and fp8 less accurate: the bound is the backend's own at that scale.
        own = reference.relative_error(cudnn8.attention(*static), exact)
        assert reference.relative_error(replayed, exact) < own * 1.15, (scale, own)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend, dtype", [("sdpa_cudnn", torch.bfloat16), ("fa3_bf16", torch.bfloat16),
                                            ("sdpa_cudnn", torch.float16), ("fa3_bf16", torch.float16)])
def test_16_bit_kernels_equal_sdpa_to_rounding(backend, dtype):
    """Also on fp16 inputs (Wan 2.2 under ComfyUI's fp16 inference), which FlashAttention-3 takes through bf16."""
    from overdrive.attention.choice import BACKENDS, EXACT_MAX_ERROR, sdpa
    q, k, v = inputs((2, 24, 3510, 128), seed=3, dtype=dtype)  # Wan 2.2 5B's self-attention at 480p, CFG batched
    why = BACKENDS[backend].applies(q, k, v)
    if why is not None:
        pytest.skip(why)
    out = BACKENDS[backend].run(q, k, v)
    assert out.shape == (2, 3510, 24, 128) and out.dtype == q.dtype
    assert reference.relative_error(out, sdpa(q, k, v)) < EXACT_MAX_ERROR / 2


def test_exact_mode_op_under_inductor_and_cuda_graphs():
    """Compile Model's attention: the op measures the 16-bit kernels at the shape's first call (outside capture), and a
    compiled caller recorded into a CUDA graph replays the chosen kernel on new inputs, to SDPA's rounding."""
    from overdrive.attention.choice import CHOOSER, EXACT_MAX_ERROR, AttentionConfig, sdpa
    from overdrive.attention.op import attend
    config = AttentionConfig("exact")
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs((1, 24, 4608, 128), seed=4))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attend(q * 1.0, k, v, config), fullgraph=True)
    first = compiled(q, k, v)
    sdpa_ms, measurements, choice = CHOOSER.reports[CHOOSER._key(q, k, config)]
    assert {m.backend for m in measurements} == {"sdpa_cudnn", "fa3_bf16"}
    assert reference.relative_error(first, sdpa(q, k, v)) < EXACT_MAX_ERROR / 2, choice
    static = [t.clone() for t in (q, k, v)]
    compiled(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = compiled(*static)
    for t in static:
        t.copy_(torch.randn_like(t))
    graph.replay()
    assert reference.relative_error(replayed, sdpa(*static)) < EXACT_MAX_ERROR / 2, choice
    torch._dynamo.reset()


def test_calls_comfyui_marks_not_low_precision_get_16_bit_kernels_only(comfy):
    """ComfyUI 0.33 passes low_precision_attention=False where 8-bit attention must not run (Wan's image
    cross-attention): under an 8-bit setting those calls are measured and run among the 16-bit kernels."""
    from overdrive.attention.choice import CHOOSER, EXACT_MAX_ERROR, AttentionConfig, sdpa
    from overdrive.comfy_host.attention_override import OverdriveAttention
    shape = (1, 24, 1040, 128)
    q4, k4, v4 = inputs(shape, seed=5)
    q, k, v = (t.transpose(1, 2).reshape(1, shape[2], -1) for t in (q4, k4, v4))  # ComfyUI's (batch, tokens, ...)
    out = OverdriveAttention(AttentionConfig("8bit"))(None, q, k, v, shape[1], low_precision_attention=False)
    modes = {key[-1].mode for key in CHOOSER.reports if key[0] == shape}
    assert modes == {"exact"}, modes
    expected = sdpa(q4, k4, v4).reshape(1, shape[2], -1)
    assert reference.relative_error(out, expected) < EXACT_MAX_ERROR / 2


def offset_inputs(shape, seed=5):
    """Inputs with the offsets trained models' K and V carry: one per head and channel, shared by all tokens."""
    q, k, v = inputs(shape, seed)
    offset = inputs((1, shape[1], 1, shape[3]), seed + 1)
    return q, k + 3.0 * offset[1], v + 2.0 * offset[2]


def test_fa3_fp8_casts_are_the_smoothed_scheme():
    """The two Triton passes: K and V smoothed over their tokens, each (batch, head) at its own scale, exactly the
    plain-torch scheme's e4m3 values (to one e4m3 step where float32 rounding sits on a boundary)."""
    from overdrive.attention import fa3_fp8
    q, k, v = (t[:, :, :1000] for t in offset_inputs((2, 4, 1000, 128)))  # views: strides as ComfyUI's
    if fa3_fp8.supports(q, k, v) is not None:
        pytest.skip(fa3_fp8.supports(q, k, v))
    q8, k8, v8, descale, v_mean = fa3_fp8.quantize(q, k, v)
    expected = reference.smoothed_e4m3(q, k, v)
    for got, scale, want in zip((q8, k8, v8), descale, expected[:3]):
        values = got.float().transpose(1, 2) * scale[:, :, None, None]
        assert reference.relative_error(values, want) < 1e-3
    assert reference.relative_error(v_mean.float().transpose(1, 2), expected[3]) < 1e-2


@pytest.mark.parametrize("shape", [(1, 24, 4608, 128), (2, 24, 3510, 128), (2, 10, 1000, 64)])
def test_fa3_fp8_is_accurate_on_offset_inputs_where_unsmoothed_fp8_is_not(shape):
    """Smoothing is what makes the fp8 kernel usable on trained models' K and V: on offset inputs its error is that of
    the scheme (P's rounding aside) and below cuDNN's fp8 graph's."""
    from overdrive.attention import fa3_fp8
    q, k, v = offset_inputs(shape)
    if fa3_fp8.supports(q, k, v) is not None:
        pytest.skip(fa3_fp8.supports(q, k, v))
    out = fa3_fp8.attention(q, k, v)
    assert out.shape == (shape[0], shape[2], shape[1], shape[3]) and out.dtype == q.dtype
    exact = reference.exact_attention(q, k, v)
    err = reference.relative_error(out.transpose(1, 2), exact)
    assert err < 0.03, err
    assert reference.relative_error(out.transpose(1, 2), reference.smoothed_fp8_attention(q, k, v)) < 0.03
    if cudnn8.supports(q, k, v) is None:
        assert err < reference.relative_error(cudnn8.attention(q, k, v).transpose(1, 2), exact)


def test_fa3_fp8_in_the_op_under_inductor_and_cuda_graphs():
    """Chosen by `8bit` mode where it is the only 8-bit backend left, it runs inside a compiled caller recorded into a
    CUDA graph, and the replay on new inputs is as accurate as a direct call."""
    from overdrive.attention import fa3_fp8
    from overdrive.attention.choice import CHOOSER, AttentionConfig
    from overdrive.attention.op import attention
    q, k, v = offset_inputs((1, 24, 4608, 128), seed=7)
    if fa3_fp8.supports(q, k, v) is not None:
        pytest.skip(fa3_fp8.supports(q, k, v))
    config = AttentionConfig("8bit", max_error=0.2)
    CHOOSER.choices[CHOOSER._key(q, k, config)] = "fa3_fp8"
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q * 1.0, k, v, config.mode, config.max_error), fullgraph=True)
    static = [t.clone() for t in (q, k, v)]
    compiled(*static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = compiled(*static)
    for t, fresh in zip(static, offset_inputs((1, 24, 4608, 128), seed=9)):
        t.copy_(fresh)
    graph.replay()
    direct = reference.relative_error(fa3_fp8.attention(*static).transpose(1, 2), reference.exact_attention(*static))
    assert reference.relative_error(replayed.transpose(1, 2), reference.exact_attention(*static)) < direct * 1.05
    torch._dynamo.reset()

"""cuDNN's fp8 attention with its casts inside the compiled graph.

Where the chooser picked cuDNN's fp8 graph for a shape, a block traced at that shape casts Q, K and V to e4m3 with
plain torch ops (each at its own maximum, this call's) and dequantizes the e4m3 output the same way, around one
opaque op that runs the cuDNN graph. Inductor then fuses the casts into the kernels that make Q, K and V (the
norms, RoPE, the concatenation of the streams) and the dequantization into the out-projection's input cast, instead
of the backend's own passes over bf16 copies (cudnn8.py: the casts, their second pass, the output's pass to bf16).
On Qwen-Image those passes took 0.27 s of a 6.5 s fp8 image (bench/README.md).

The decision is made when the block is traced, from the chooser's measurement at that shape: Quantize Model's
calibration runs the model with Overdrive's attention, so the shapes it samples at are measured before Compile
Model traces. A shape traced before it was measured, or a later shape of the graph (which may trace with symbolic
sizes), keeps the run-time choice of `torch.ops.overdrive.attention`. Per-call maxima read Q, K and V once more than the carried
scales of cudnn8.py, but need no state in the graph and are never stale, so the error is at most the chooser's.
"""
from __future__ import annotations

import logging

import torch

from ..compiler.trace_state import static_shapes
from ..quantization.kernels import FP8_DTYPE, FP8_MAX
from . import cudnn8
from .choice import CHOOSER, AttentionConfig

log = logging.getLogger("overdrive")


@torch.compiler.assume_constant_result
def _chosen(shape_q: tuple, shape_k: tuple, dtype: str, device: str, settings: tuple) -> str:
    """The chooser's backend for a shape, read while tracing as a constant (no guard: a later measurement at
    another shape does not recompile this graph). Quantize Model calibrates with CFG (a batch of 2); a sampler at
    CFG 1 runs the same attention at batch 1, so a shape measured at another batch size stands in. `settings`: the
    AttentionConfig's fields (a precompiled frame cannot hold the object itself)."""
    config = AttentionConfig(*settings)
    choice = CHOOSER.choices.get((shape_q, shape_k, dtype, device, config))
    if choice is None:
        choice = next((made for (q, k, *rest), made in CHOOSER.choices.items()
                       if q[1:] == shape_q[1:] and k[1:] == shape_k[1:] and tuple(rest) == (dtype, device, config)), "")
    if choice == "cudnn_fp8":
        log.info("Overdrive attention %s: cuDNN's fp8 graph, its casts compiled into the block", shape_q)
    return choice


def applies(q: torch.Tensor, k: torch.Tensor, config: AttentionConfig) -> bool:
    """Whether a call being traced takes the fused path: a trace of static sizes (compiler/trace_state.py: Overdrive's
    compiler, at a graph's first shape) at a shape that the chooser gave to cuDNN's fp8 graph. A shape-generic graph
    serves sizes the chooser may have judged otherwise, and its sizes cannot be looked up."""
    if not (config.fused_casts and torch.compiler.is_compiling() and static_shapes()):
        return False
    settings = (config.mode, config.max_error, config.fused_casts)
    return _chosen(tuple(q.shape), tuple(k.shape), str(q.dtype), str(q.device), settings) == "cudnn_fp8"


def to_e4m3(x: torch.Tensor):
    """(e4m3 copy of x at its own maximum, its descale as a 0-dim float32 tensor)."""
    descale = (x.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
    return (x.float() / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), descale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head dim) q, k, v -> (batch, tokens, heads, head dim) in q's dtype, traced."""
    (q8, dq), (k8, dk), (v8, dv) = to_e4m3(q), to_e4m3(k), to_e4m3(v)
    out8 = torch.ops.overdrive.cudnn_fp8_sdpa(q8, k8, v8, torch.stack([dq, dk, dv, 1.0 / dv]))
    return (out8.float() * dv).to(q.dtype)


@torch.library.custom_op("overdrive::cudnn_fp8_sdpa", mutates_args=())
def cudnn_fp8_sdpa(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 (batch, heads, tokens, head dim) q8, k8, v8 (head dim contiguous), scales [dq, dk, dv, 1 / dv] -> e4m3
    softmax(q·kᵀ/√d)·v / dv as (batch, tokens, heads, head dim), contiguous. cuDNN's graph on CUDA; elsewhere the
    same arithmetic in float32 (what the CPU tests run)."""
    if q8.is_cuda:
        return cudnn8.run_quantized(q8, k8, v8, scales)
    q, k, v = (t.float() * s for t, s in zip((q8, k8, v8), scales[:3]))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v) * scales[3]
    return out.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).transpose(1, 2).contiguous()


@cudnn_fp8_sdpa.register_fake
def _(q8, k8, v8, scales):
    batch, heads, tokens, dim = q8.shape
    return q8.new_empty((batch, tokens, heads, v8.shape[-1]))

"""cuDNN's fp8 attention handing its e4m3 output to the compiled graph, which dequantizes it inside the kernel that
reads it next.

Run as an opaque op, cuDNN's fp8 attention (cudnn8.py) writes e4m3 and a Triton pass dequantizes that into a 16-bit
copy in the op's layout; the fp8 out-projection after it then reads the copy back and casts it to e4m3 again. Where
the chooser picked cuDNN's fp8 graph for a shape, a block traced at that shape instead calls
`overdrive::attention_e4m3`, which returns cuDNN's e4m3 output (written tokens-major, the layout the out-projection
reads) with its descale, and multiplies the two in traced code: Inductor fuses that into the out-projection's input
cast (or whatever reads the output), so the 16-bit copy is never written (its cost on Qwen-Image:
bench/experiments/e4m3-attention-output.md).
Q, K and V keep the backend's own casts with carried scales: casting them in the graph measured slower.

The decision is made when the block is traced, from the chooser's measurement at that shape: Quantize Model's
calibration runs the model with Overdrive's attention, so the shapes it samples at are measured before Compile
Model traces. A shape traced before it was measured keeps the run-time choice of `torch.ops.overdrive.attention`, and
so does a precompiled frame saved then (compiler/precompiled.py), until the frames are built again.
"""
from __future__ import annotations

import logging

import torch

from ..core.cuda_streams import capturing, out_of_memory
from ..quantization.kernels import EPS, FP8_DTYPE, FP8_MAX
from . import cudnn8
from .choice import CHOOSER, AttentionConfig, sdpa

log = logging.getLogger("overdrive")
_failed_shapes: set = set()
_logged_shapes: set = set()


def _settings(config: AttentionConfig) -> tuple:
    """The config's fields in order (`dataclasses.astuple`, which Dynamo cannot trace)."""
    return tuple(getattr(config, name) for name in AttentionConfig.__dataclass_fields__)


@torch.compiler.assume_constant_result
def _cudnn_fp8_shapes() -> frozenset:
    """What the chooser gave to cuDNN's fp8 graph so far, as (q's and k's shapes without the batch, dtype, device,
    config fields): read while tracing as a constant, with no guard, so a later measurement does not recompile a graph.
    Quantize Model calibrates with CFG (a batch of 2); a sampler at CFG 1 runs the same attention at batch 1, so the
    batch size is left out."""
    return frozenset((q[1:], k[1:], dtype, device, _settings(config))
                     for (q, k, dtype, device, config), made in list(CHOOSER.choices.items()) if made == "cudnn_fp8")


def applies(q: torch.Tensor, k: torch.Tensor, config: AttentionConfig) -> bool:
    """Whether a call being traced takes this path: at a shape the chooser gave to cuDNN's fp8 graph. Compared size
    by size, so that a trace with symbolic sizes (a shape-generic graph) gets a guard on them rather than a lookup it
    cannot make: such a graph takes the path only at a chosen shape, and recompiles for it."""
    if not (config.e4m3_output and torch.compiler.is_compiling()):
        return False
    key = (str(q.dtype), str(q.device), _settings(config))
    return any(tuple(q.shape[1:]) == shape_q and tuple(k.shape[1:]) == shape_k and (dtype, device, settings) == key
               for shape_q, shape_k, dtype, device, settings in _cudnn_fp8_shapes())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, heads, tokens, head dim) q, k, v -> (batch, tokens, heads, head dim) in q's dtype, its dequantization
    traced."""
    out8, descale = torch.ops.overdrive.attention_e4m3(q, k, v)
    return (out8.float() * descale).to(q.dtype)


def _quantized_sdpa(q, k, v):
    """SDPA's output as the op returns it: e4m3 over V's maximum (|O| <= max |V|), tokens-major."""
    descale = (v.abs().amax().float() / FP8_MAX).clamp_min(EPS).reshape(1)
    return (sdpa(q, k, v).float() / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), descale


@torch.library.custom_op("overdrive::attention_e4m3", mutates_args=())
def attention_e4m3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, heads, tokens, head dim) q, k, v -> (e4m3 (batch, tokens, heads, head dim), descale (1,) float32).
    cuDNN's fp8 graph on CUDA; off the GPU, or where cuDNN fails (logged once per shape), SDPA's output cast the same
    way."""
    shape = tuple(q.shape)
    if q.is_cuda and shape not in _failed_shapes:
        if shape not in _logged_shapes:
            _logged_shapes.add(shape)
            log.info("Overdrive attention %s: cuDNN's fp8 graph, its e4m3 output read by the compiled block", shape)
        try:
            return cudnn8.attention_e4m3(q, k, v)
        except Exception as error:  # noqa: BLE001 - a generation never fails because of an optimization
            if capturing():
                raise  # the recorder runs the block without a graph (attention/op.py)
            if out_of_memory(error):
                return _quantized_sdpa(q, k, v)  # the card's state at this call: cuDNN's graph stays for the next
            _failed_shapes.add(shape)
            log.warning("Overdrive attention: cuDNN's fp8 graph failed at %s (%s: %s); SDPA runs there, its output "
                        "cast to e4m3 for the compiled block", shape, type(error).__name__,
                        str(error).splitlines()[0][:300] if str(error) else "")
    return _quantized_sdpa(q, k, v)


@attention_e4m3.register_fake
def _(q, k, v):
    batch, heads, tokens, dim = q.shape
    return (q.new_empty((batch, tokens, heads, v.shape[-1]), dtype=FP8_DTYPE),
            q.new_empty((1,), dtype=torch.float32))

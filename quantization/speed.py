"""Measured speed of a layer's 8-bit path against its float GEMM, at the layer's real shape, on this GPU.

Density (FLOP/byte) says whether low precision *could* pay; whether it does depends on the GPU, the shape and the
kernels (on an H100 at SDXL's sizes, W8A8 with per-token activation scales was slower than fp16 under compile for
many layers). So on CUDA each candidate that passed the density and error checks is timed: the float layer itself
against its quantized replacement (activation quantization, the int8/fp8 GEMM, rescale and bias; for a 1x1 conv
also the layout change), both on a random input of the layer's largest calibration shape, each captured in a
CUDA graph of `REPEATS` calls and replayed, so launch overhead does not count (under a compiled model with CUDA
graphs it does not either). A dynamic activation scale is timed with its quantization pass (a reduction over the
input, then the cast). A static fp8 scale makes the cast elementwise, and under torch.compile Inductor fuses it into
the kernel that produces the input (which then writes 1 byte per value instead of 2): such a layer is timed as the
GEMM on an already cast input, as it runs compiled. Without Compile Model the cast is one more kernel per layer.

Timings are memoised per GPU, format, dtype and shape for the process: a UNet has a few dozen distinct shapes.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..core.cuda_streams import side_stream
from .linear_layers import baseline

log = logging.getLogger("overdrive.quantization")

REPEATS = 10   # calls per captured graph
REPLAYS = 5    # timed replays (after one warm replay)

_timings: dict = {}
_lock = threading.Lock()


def graph_seconds(fn) -> float:
    """Seconds per call of `fn()` (already warm), from a CUDA graph of REPEATS calls replayed REPLAYS times."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000.0 / (REPEATS * REPLAYS)
    del graph
    return seconds


def warm_up(fn) -> None:
    # Outside the capture: Triton JIT, cuBLAS heuristics and workspaces happen here, on a side stream as capture needs.
    stream = side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def compiled_cost(quantized, x: torch.Tensor):
    """A call of `quantized` on `x` that costs what the layer costs in a compiled model (see the module docstring)."""
    from . import formats
    plugin = formats.REGISTRY.get(quantized.format)  # weight-only storage is no registered format: called as is
    return plugin.compiled_call(quantized, x) if plugin is not None else (lambda: quantized(x))


def measured_speedup(module, quantized, input_shape: tuple, dtype: torch.dtype) -> float | None:
    """Time of `module` (the float nn.Linear / 1x1 nn.Conv2d, or a layer the checkpoint stores in low bits run by its
    own kernels, on its CUDA device) / time of `quantized` (its 8-bit replacement) on a random input of `input_shape`
    and `dtype`; None where nothing can be timed (not CUDA)."""
    weight = module.weight
    if weight.device.type != "cuda" or not input_shape or 0 in input_shape:
        return None
    device = weight.device
    key = (torch.cuda.get_device_name(device), quantized.format, str(dtype), type(module).__name__,
           type(weight).__name__, tuple(input_shape), tuple(weight.shape), module.bias is not None)
    with _lock:
        if key in _timings:
            return _timings[key]
        with torch.no_grad(), torch.cuda.device(device):
            generator = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(*input_shape, device=device, dtype=dtype, generator=generator)
            quantized = quantized.to(device)
            quantized_call = compiled_cost(quantized, x)
            warm_up(lambda: module(x))
            warm_up(quantized_call)
            speedup = graph_seconds(lambda: module(x)) / graph_seconds(quantized_call)
        _timings[key] = speedup
        log.debug("Overdrive quantization: %s %s %s on %s: %.2fx %s's speed", key[1], key[3],
                  "x".join(map(str, input_shape)), key[0], speedup, baseline(module))
        return speedup


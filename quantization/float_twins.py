"""Layers measured over copies of their float weights on the card.

Under ComfyUI's dynamic VRAM a model's float weights stay in host memory (its checkpoint, memory-mapped) and are
copied in at each call. Measuring a layer there copied its weight to the card twice (the quantized layer, the float
reference) and could not time it at all (the float layer's own call reads host memory). Here each candidate is
measured as a plain torch layer over one copy of its weight on the card (what the loaded model runs), the next
layer's copy under way meanwhile (core/weights_ahead.py); the copies go as each layer is decided.
"""
import dataclasses
from typing import Iterator

import torch.nn as nn
import torch.nn.functional as F

from ..core.weights_ahead import on_device_ahead
from .candidates import Candidate
from .linear_layers import stored_in_float


def measured_beside_rows(candidates: list, samples: dict) -> Iterator[Candidate]:
    """`candidates` in order; one whose calibration rows are on another device than its plain float weight (rows on
    the card, the weight on the host) over a float twin of its layer on the rows' device, every other one as it is."""
    moved = [c for c in candidates if _twinned(c, samples.get(c.name))]
    device = samples[moved[0].name].rows.device if moved else None
    moved = [c for c in moved if samples[c.name].rows.device == device]  # one card's rows (the calibration's)
    arriving = on_device_ahead([(c.module.weight, c.module.bias) for c in moved], device) if moved else iter(())
    twins = {c.name for c in moved}
    try:
        for candidate in candidates:  # the twin referenced by the caller alone: gone before the next layer arrives
            yield (dataclasses.replace(candidate, module=float_twin(candidate.module, *next(arriving)))
                   if candidate.name in twins else candidate)
    finally:
        if moved:
            arriving.close()


def _twinned(candidate: Candidate, sample) -> bool:
    module = candidate.module
    return (candidate.skip_reason is None and sample is not None and sample.rows is not None
            and isinstance(module, (nn.Linear, nn.Conv2d)) and stored_in_float(module.weight)
            and module.weight.device != sample.rows.device)


def float_twin(module: nn.Module, weight, bias) -> nn.Module:
    """A plain torch layer of `module`'s kind and geometry over `weight` and `bias` (quantized and measured as they
    are), which runs its calls in its input's dtype."""
    if isinstance(module, nn.Conv2d):
        twin = ConvTwin(module.in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                        module.dilation, module.groups, bias=bias is not None, padding_mode=module.padding_mode,
                        device="meta")
    else:
        twin = LinearTwin(module.in_features, module.out_features, bias=bias is not None, device="meta")
    twin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        twin.bias = nn.Parameter(bias, requires_grad=False)
    twin.cast = None  # (weight, bias) in the dtype of the calls, once one comes in another
    return twin


def _weights_in(twin: nn.Module, dtype) -> tuple:
    """The twin's weight and bias in `dtype`, cast once. A file may store another dtype than its layer computes in
    (a bf16 Wan file under fp16): dynamic VRAM casts at each call and the classic loader a compiled model runs on
    casts once, so the float call timed against the quantized one is the one in the input's dtype."""
    if all(t is None or t.dtype == dtype for t in (twin.weight, twin.bias)):
        return twin.weight, twin.bias
    if twin.cast is None or twin.cast[0].dtype != dtype:
        twin.cast = (twin.weight.to(dtype), None if twin.bias is None else twin.bias.to(dtype))
    return twin.cast


class LinearTwin(nn.Linear):
    def forward(self, x):
        return F.linear(x, *_weights_in(self, x.dtype))


class ConvTwin(nn.Conv2d):
    def forward(self, x):
        return self._conv_forward(x, *_weights_in(self, x.dtype))

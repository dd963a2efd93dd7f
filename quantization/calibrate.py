"""Calibration: collect real inputs of the candidate layers while the caller runs the model, then measure and decide.

    with Calibrator(model, config) as cal:
        run_model()              # a few sampling steps, as usual (eager, not compiled)
    decisions, modules = cal.decide(fmt)

Forward pre-hooks keep a bounded random subsample of each layer's input rows (tokens of a linear, pixels of a
1x1 conv): at most `config.calibration_tokens` rows per layer whatever the resolution, spread over the calls
seen (each call replaces a 1/calls share of the rows). Measuring is one small GEMM per layer on those rows, with
the real quantized kernel, against a float32 reference: seconds for a whole UNet, no model re-runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.interrupts import raise_if_interrupt
from . import formats, metrics, speed
from .candidates import Candidate, FilterFn, find_candidates
from .config import QuantConfig
from .float_twins import measured_beside_rows
from .linear_layers import baseline, float_weight
from .modules import gemm_of, quantized_module_for, weight_only_module_for
from .report import QUANTIZE, SKIP, LayerDecision

log = logging.getLogger("overdrive.quantization")


@dataclasses.dataclass
class LayerSample:
    rows: torch.Tensor | None = None   # (n <= calibration_tokens, K), the input's dtype and device
    calls: int = 0
    max_rows: int = 0                  # M of the largest call
    input_shape: tuple | None = None   # input shape of the largest call
    output_hw: tuple | None = None     # conv: output H, W of the largest call
    amax: torch.Tensor | None = None   # largest |input| over every call (0-d float32, on the input's device)


class Calibrator:
    """Context manager that records calibration inputs of `model`'s candidate layers (see module docstring)."""

    def __init__(self, model: nn.Module, config: QuantConfig | None = None, filter_fn: FilterFn | None = None,
                 seed: int = 0):
        self.model = model
        self.config = (config or QuantConfig()).validate()
        self.filter_fn = filter_fn
        self.candidates = find_candidates(model, self.config, None, filter_fn)
        self.samples = {c.name: LayerSample() for c in self.candidates if c.record_inputs}
        self._generator = torch.Generator().manual_seed(seed)
        self._handles = []
        self.seconds = 0.0
        self._entered_at = None

    # -- recording -------------------------------------------------------------------------------------------
    def __enter__(self) -> "Calibrator":
        if self._handles:
            raise RuntimeError("Calibrator is already recording; leave the first `with` block before entering again.")
        for candidate in self.candidates:
            if candidate.record_inputs:
                self._handles.append(candidate.module.register_forward_pre_hook(self._hook(candidate)))
        self._entered_at = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._entered_at is not None:
            self.seconds += time.perf_counter() - self._entered_at
            self._entered_at = None
        return False

    @property
    def recorded(self) -> bool:
        return any(sample.calls for sample in self.samples.values())

    def _hook(self, candidate: Candidate):
        sample = self.samples[candidate.name]
        measurable = candidate.skip_reason is None

        def hook(module, args):
            if not args or not isinstance(args[0], torch.Tensor):
                return None
            with torch.no_grad():
                self._record(candidate, module, sample, args[0], measurable)
            return None

        return hook

    def _rand_index(self, high: int, count: int, device) -> torch.Tensor:
        return torch.randperm(high, generator=self._generator)[:count].to(device, non_blocking=True)

    def _record(self, candidate: Candidate, module: nn.Module, sample: LayerSample, x: torch.Tensor,
                measurable: bool):
        if candidate.kind == "linear":
            k = x.shape[-1]
            m = x.numel() // max(k, 1)
        else:
            if x.dim() == 3:
                x = x.unsqueeze(0)
            b, k, h, w = x.shape
            m = b * h * w
        sample.calls += 1
        if m >= sample.max_rows:
            sample.max_rows = m
            sample.input_shape = tuple(x.shape)
            if candidate.kind != "linear":
                sample.output_hw = metrics.conv2d_output_hw(module, x.shape[2], x.shape[3])
        if not measurable or m == 0:
            return
        amax = torch.linalg.vector_norm(x, float("inf")).float()  # one reduction, no host sync
        sample.amax = amax if sample.amax is None else torch.maximum(sample.amax, amax)
        cap = self.config.calibration_tokens
        have = 0 if sample.rows is None else sample.rows.shape[0]
        if have < cap:           # still filling: take what is missing
            take = min(m, cap - have)
        else:                    # full: this call replaces a 1/calls share of the rows
            take = min(m, max(1, math.ceil(cap / sample.calls)))
        index = self._rand_index(m, take, x.device)
        if candidate.kind == "linear":
            rows = x.reshape(-1, k).index_select(0, index)
        else:
            hw = x.shape[2] * x.shape[3]
            rows = x.flatten(2)[index // hw, :, index % hw]
        rows = rows.detach()
        if sample.rows is None:
            sample.rows = rows.clone()
        elif have < cap:
            sample.rows = torch.cat([sample.rows, rows.to(sample.rows.dtype)])
        else:
            positions = self._rand_index(cap, take, sample.rows.device)
            sample.rows[positions] = rows.to(sample.rows.dtype)

    # -- measuring and deciding ------------------------------------------------------------------------------
    def decide(self, fmt: str, config: QuantConfig | None = None, between_layers=None, store_device=None):
        """Measure every measurable layer with format `fmt` and decide. Returns (decisions, {name: module})."""
        return decide(self.candidates, self.samples, config or self.config, fmt, between_layers, store_device)


def measure_layer(module: nn.Module, rows: torch.Tensor, fmt: str, config: QuantConfig,
                  input_amax: torch.Tensor | None = None):
    """Quantize `module` to `fmt` and measure its normalised MSE on `rows`: returns (quantized module, error).
    `input_amax` finishes the layer where its format uses it (fp8's static activation scale)."""
    quantized = quantized_module_for(module, fmt, config, device=rows.device, input_amax=input_amax)
    return quantized, measured_error(module, quantized, rows)


def measured_error(module: nn.Module, quantized: nn.Module, rows: torch.Tensor) -> float:
    """Normalised MSE of `quantized` (the replacement of `module`) on `rows`, against float32."""
    gemm = gemm_of(quantized)
    weight = float_weight(module).detach().to(rows.device)
    weight = weight.reshape(weight.shape[0], -1).float()
    bias = None if module.bias is None else module.bias.detach().to(rows.device).float()
    with torch.no_grad():
        reference = F.linear(rows.float(), weight, bias)
        output = gemm.gemm(rows, rows.dtype)
    return metrics.normalised_mse(output, reference)


def layer_density(candidate: Candidate, sample: LayerSample | None) -> float | None:
    if sample is None or sample.input_shape is None:
        return None
    module = candidate.module
    if candidate.kind == "linear":
        return metrics.linear_density(sample.max_rows, module.in_features, module.out_features)
    b = sample.input_shape[0]
    output_shape = (b, module.out_channels, *sample.output_hw)
    return metrics.conv2d_density(sample.input_shape, tuple(module.weight.shape), output_shape, module.groups)


def _too_slow(decision: LayerDecision, candidate: Candidate, sample: LayerSample, quantized: nn.Module,
              config: QuantConfig, fmt: str) -> str | None:
    """On CUDA with min_speedup > 0: time the layer (see speed.py). Why it stays in float, or None to quantize it."""
    if config.min_speedup <= 0:
        return None
    try:
        decision.speedup = speed.measured_speedup(candidate.module, quantized, sample.input_shape, sample.rows.dtype)
    except Exception as error:  # noqa: BLE001 - timing is an optimisation check: never fail the run over it
        raise_if_interrupt(error)
        log.warning("Overdrive quantization: could not time %s (%s); it stays in float.", candidate.name, error)
        return f"measuring its speed failed ({type(error).__name__}), so it stays in float"
    if decision.speedup is None or decision.speedup >= config.min_speedup:
        return None
    return (f"measured {decision.speedup:.2f}x {baseline(candidate.module)}'s speed in {fmt} at input "
            f"{'x'.join(map(str, sample.input_shape))} (< min_speedup {config.min_speedup:g})")


def _stored_in_int8(decision: LayerDecision, candidate: Candidate, sample: LayerSample,
                    config: QuantConfig) -> nn.Module | None:
    """A memory-bound layer: its weight-only int8 replacement where the error passes (the decision says so), or
    None (it stays in float; the reason says why)."""
    stored = weight_only_module_for(candidate.module, device=sample.rows.device)
    decision.error = measured_error(candidate.module, stored, sample.rows)
    if not decision.error < decision.threshold:
        decision.reason += f"; weight-only int8 error {decision.error:.2e} >= threshold {decision.threshold:g}"
        return None
    decision.decision, decision.weight_only = QUANTIZE, True
    decision.reason = (f"weight-only int8 (memory-bound: density {decision.density:.0f} < "
                       f"{config.compute_density_threshold:g} FLOP/byte, so half the bytes instead of an 8-bit GEMM): "
                       f"error {decision.error:.2e} < {decision.threshold:g}")
    return stored


# Below a tensor-core tile of rows an 8-bit GEMM streams the same 8-bit weight as the weight-only kernel and computes
# mostly padding: its edge is at most the kernels' bandwidth, while int8 with a scale per output channel keeps far
# less error than e4m3 with one per tensor. (Flux's modulation linears, one row a call, measured barely faster as
# fp8 GEMMs, and the model call's error grew.)
GEMM_MIN_ROWS = 16


def _gemm_if_faster(decision: LayerDecision, candidate: Candidate, sample: LayerSample, stored: nn.Module,
                    config: QuantConfig, fmt: str) -> nn.Module | None:
    """A memory-bound layer already stored in int8: its 8-bit GEMM instead where, at the layer's input shape, that
    measures `min_speedup` times the weight-only kernel's speed and its error passes; else None (it stays weight-only).
    Both read the same 8-bit weight, but with tens of rows (Qwen-Image's text stream: 64 tokens, 128 with CFG) the
    weight-only kernel's dequantize-and-multiply is slower than the tensor cores' 8-bit product. CUDA only, and only
    with timing on (`min_speedup` > 0): density alone keeps the weight-only choice. Only with at least
    GEMM_MIN_ROWS rows, and where the weight outweighs the input and output (rows x (K + N) <= K x N values):
    elsewhere, as in a final projection to a few channels over every token, 8 bits on the weight save little, while
    the GEMM's e4m3 rounding of the input lands on the output."""
    if config.min_speedup <= 0 or sample.rows.device.type != "cuda":
        return None
    k, n, rows = candidate.in_features, candidate.out_features, sample.max_rows
    if rows < GEMM_MIN_ROWS or rows * (k + n) > k * n:
        return None
    quantized, error = measure_layer(candidate.module, sample.rows, fmt, config, sample.amax)
    try:
        stored_speedup = speed.measured_speedup(candidate.module, stored, sample.input_shape, sample.rows.dtype)
        gemm_speedup = (speed.measured_speedup(candidate.module, quantized, sample.input_shape, sample.rows.dtype)
                        if error < decision.threshold else None)
    except Exception as failure:  # noqa: BLE001 - timing is an optimisation check: never fail the run over it
        raise_if_interrupt(failure)
        log.info("Overdrive quantization: could not time %s's 8-bit GEMM (%s); it stays weight-only.",
                 candidate.name, failure)
        return None
    decision.speedup = stored_speedup
    if stored_speedup is None or gemm_speedup is None or not gemm_speedup >= config.min_speedup * stored_speedup:
        if stored_speedup and gemm_speedup:
            decision.reason += f"; its {fmt} GEMM measured {gemm_speedup / stored_speedup:.2f}x its speed"
        return None
    decision.weight_only, decision.error, decision.speedup = False, error, gemm_speedup
    decision.input_amax = None if sample.amax is None else float(sample.amax)
    decision.reason = (f"{fmt} GEMM (memory-bound at density {decision.density:.0f}, but measured "
                       f"{gemm_speedup / stored_speedup:.2f}x the weight-only kernel's speed at input "
                       f"{'x'.join(map(str, sample.input_shape))}): error {error:.2e} < {decision.threshold:g}")
    return quantized


def decide(candidates: list, samples: dict, config: QuantConfig, fmt: str, between_layers=None,
           store_device=None):
    """Per layer: kernel available? called? density >= threshold? error < threshold? -> LayerDecision.
    `between_layers()`, if given, is called before each layer's measurement: a host's stop check (it raises).
    `store_device`, if given, is where each chosen module goes as soon as it is decided: on a card that holds the
    float model only partly, the 8-bit layers must not pile up beside it (one layer at a time is measured there)."""
    decisions, modules = [], {}
    with contextlib.closing(measured_beside_rows(candidates, samples)) as measured:
        for candidate in measured:
            if between_layers is not None:
                between_layers()
            decision, module = decide_layer(candidate, samples.get(candidate.name), config, fmt)
            decisions.append(decision)
            if module is not None:
                modules[candidate.name] = module if store_device is None else module.to(store_device)
            del candidate, module  # a twin's weights go before the next layer's arrive
    for decision in decisions:
        if decision.decision != QUANTIZE:
            decision.decision = SKIP
    return decisions, modules


def _new_decision(candidate: Candidate, sample: LayerSample | None, config: QuantConfig) -> LayerDecision:
    module = candidate.module
    decision = LayerDecision(name=candidate.name, kind=candidate.kind, shape=list(module.weight.shape),
                             threshold=config.threshold_for(candidate.kind))
    if sample is not None:
        decision.calls = sample.calls
        decision.rows = sample.max_rows if sample.calls else None
        decision.density = layer_density(candidate, sample)
    return decision


def decide_layer(candidate: Candidate, sample: LayerSample | None, config: QuantConfig, fmt: str):
    """(LayerDecision, the replacement module or None) for one candidate layer and its calibration sample."""
    if formats.get(fmt).bits < 8:
        return _decide_narrow(candidate, sample, config, fmt)
    module = candidate.module
    decision = _new_decision(candidate, sample, config)
    reason = candidate.skip_reason
    if reason is None:
        reason = formats.get(fmt).shape_problem(candidate.in_features, candidate.out_features)
    if reason is None and sample is None:
        reason = "no calibration inputs recorded (the Calibrator did not hook this layer)"
    if reason is None and sample.rows is None:
        reason = "not called during calibration (no inputs to measure)"
    if reason is not None:
        decision.reason = reason
        return decision, None
    if not decision.density >= config.compute_density_threshold:
        decision.reason = (f"density {decision.density:.0f} < {config.compute_density_threshold:g} FLOP/byte "
                           f"(memory-bound: low precision would not speed it up)")
        if not config.weight_only:  # the report still shows what the 8-bit GEMM would cost in error
            decision.error = measure_layer(module, sample.rows, fmt, config, sample.amax)[1]
            return decision, None
        stored = _stored_in_int8(decision, candidate, sample, config)
        if stored is None:
            return decision, None
        gemm = _gemm_if_faster(decision, candidate, sample, stored, config, fmt)
        return decision, stored if gemm is None else gemm
    quantized, decision.error = measure_layer(module, sample.rows, fmt, config, sample.amax)
    if not decision.error < decision.threshold:
        decision.reason = f"error {decision.error:.2e} >= threshold {decision.threshold:g}"
        return decision, None
    if (slow := _too_slow(decision, candidate, sample, quantized, config, fmt)) is not None:
        decision.reason = slow
        return decision, None
    decision.decision = QUANTIZE
    decision.reason = f"{fmt}: error {decision.error:.2e} < {decision.threshold:g}, " \
                      f"density {decision.density:.0f} >= {config.compute_density_threshold:g}"
    if decision.speedup is not None:
        decision.reason += f", measured {decision.speedup:.2f}x faster"
    decision.input_amax = None if sample.amax is None else float(sample.amax)
    return decision, quantized


def _decide_narrow(candidate: Candidate, sample: LayerSample | None, config: QuantConfig, fmt: str):
    """A format below 8 bits (int4): the layer takes it wherever its kernel fits and its error passes, memory-bound or
    not and without timing against float (a 4-bit choice is for memory: a card that holds the model whole, or half the
    bytes streamed); else it gets the 8-bit decision of the device's best 8-bit format."""
    why = candidate.skip_reason or formats.get(fmt).shape_problem(candidate.in_features, candidate.out_features)
    if why is None and sample is not None and sample.rows is not None:
        quantized, error = measure_layer(candidate.module, sample.rows, fmt, config, sample.amax)
        if error < config.int4_mse_threshold:
            decision = _new_decision(candidate, sample, config)
            decision.decision, decision.error, decision.format = QUANTIZE, error, fmt
            decision.threshold = config.int4_mse_threshold
            decision.reason = f"{fmt}: error {error:.2e} < {decision.threshold:g} (4 bits for memory: not timed)"
            decision.input_amax = None if sample.amax is None else float(sample.amax)
            return decision, quantized
        why = f"{fmt} error {error:.2e} >= int4_mse_threshold {config.int4_mse_threshold:g}"
    device = sample.rows.device if sample is not None and sample.rows is not None else candidate.module.weight.device
    fallback = formats.best_supported(device, 8)
    if fallback is None:
        decision = _new_decision(candidate, sample, config)
        decision.reason = why or "no 8-bit format runs on this device"
        return decision, None
    decision, module = decide_layer(candidate, sample, config, fallback.name)
    if decision.quantized and not decision.weight_only:
        decision.format = fallback.name
    if why is not None and why != candidate.skip_reason:
        decision.reason += f"; {why}"
    return decision, module

"""`QuantReport`: one line per candidate layer (what it is, what was measured, what was decided and why)."""
from __future__ import annotations

import collections
import dataclasses
import json
import math

from .metrics import sqnr_db

QUANTIZE = "quantize"
SKIP = "skip"
REPORT_VERSION = 1


@dataclasses.dataclass
class LayerDecision:
    name: str
    kind: str                      # "linear", "conv1x1", "conv3x3", ...
    shape: list                    # the float weight's shape
    decision: str = SKIP           # "quantize" or "skip"
    reason: str = ""
    density: float | None = None   # FLOP/byte at fp16 for the largest call seen
    error: float | None = None     # normalised MSE on calibration inputs (see metrics.py)
    threshold: float | None = None
    speedup: float | None = None   # float time / 8-bit time, measured on the GPU at this layer's shape
    rows: int | None = None        # M: rows (tokens / pixels) of the largest call seen
    calls: int = 0                 # calls seen during calibration
    input_amax: float | None = None  # largest |input| in calibration: a quantized layer rebuilt from the cached
    #                                  decisions gets the same static activation scale (fp8)
    weight_only: bool = False      # quantized as weight-only int8 storage (memory-bound), not as an 8-bit GEMM
    format: str | None = None      # the format this layer runs in, where a 4-bit plan put it in 8 bits (or in 4)

    @property
    def quantized(self) -> bool:
        return self.decision == QUANTIZE


def _num(value):
    """JSON has no inf/nan: store them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


_NUMERIC = ("density", "error", "threshold", "speedup", "input_amax")


def _unnum(value):
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return value


def _category(reason: str) -> str:
    if reason.startswith("density"):
        return "memory-bound (density below threshold)"
    if reason.startswith("error"):
        return "error above threshold"
    if reason.startswith("measured"):
        return "not faster in 8 bits (measured)"
    if reason.startswith(("K=", "N=")):
        return "shape the kernel cannot take"
    return reason.split(" (")[0]


@dataclasses.dataclass
class QuantReport:
    format: str
    device: str
    config: dict
    layers: list = dataclasses.field(default_factory=list)
    cache_hit: bool = False        # decisions came from the on-disk cache: no calibration ran
    calibrated: bool = False       # calibration inputs were collected and measured in this run
    cache_key: str | None = None
    seconds: dict = dataclasses.field(default_factory=dict)

    # -- queries ---------------------------------------------------------------------------------------------
    @property
    def quantized(self) -> list:
        return [layer.name for layer in self.layers if layer.quantized]

    @property
    def weight_only(self) -> list:
        return [layer.name for layer in self.layers if layer.quantized and layer.weight_only]

    def formats(self) -> dict:
        """{quantized layer: the format it runs in}."""
        return {layer.name: "int8 weight-only" if layer.weight_only else layer.format or self.format
                for layer in self.layers if layer.quantized}

    @property
    def skipped(self) -> list:
        return [layer.name for layer in self.layers if not layer.quantized]

    def __getitem__(self, name: str) -> LayerDecision:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def summary(self) -> str:
        reasons = collections.Counter(_category(layer.reason) for layer in self.layers if not layer.quantized)
        why = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common())
        source = "cached decisions" if self.cache_hit else "calibrated" if self.calibrated else "no calibration"
        stored = len(self.weight_only)
        others = collections.Counter(fmt for fmt in self.formats().values()
                                     if fmt not in (self.format, "int8 weight-only"))
        text = (f"Overdrive quantization ({self.format} on {self.device}, {source}): "
                f"{len(self.quantized) - stored} of {len(self.layers)} layers quantized"
                + "".join(f", {count} of them in {fmt}" for fmt, count in others.items())
                + (f", {stored} memory-bound layer(s) stored in int8 (weight-only)" if stored else ""))
        return text + (f"; skipped: {why}" if why else "")

    def table(self) -> str:
        """A fixed-width table, one row per layer, for the log."""
        head = ("layer", "kind", "shape", "M", "density", "error", "SQNR dB", "speed-up", "decision", "reason")
        rows = [head]
        for layer in self.layers:
            db = sqnr_db(layer.error)
            rows.append((layer.name, layer.kind, "x".join(map(str, layer.shape)),
                         "" if layer.rows is None else str(layer.rows),
                         "" if layer.density is None else f"{layer.density:.0f}",
                         "" if layer.error is None else f"{layer.error:.2e}",
                         "" if db is None else f"{db:.1f}",
                         "" if layer.speedup is None else f"{layer.speedup:.2f}x",
                         layer.decision, layer.reason))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths)) + "  " + row[-1]
                 for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join([self.summary()] + lines)

    # -- serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        layers = [{k: _num(v) for k, v in dataclasses.asdict(layer).items()} for layer in self.layers]
        return {"version": REPORT_VERSION, "format": self.format, "device": self.device, "config": self.config,
                "layers": layers, "cache_hit": self.cache_hit, "calibrated": self.calibrated,
                "cache_key": self.cache_key, "seconds": self.seconds}

    def to_json(self, indent=None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "QuantReport":
        if not isinstance(data, dict) or data.get("version") != REPORT_VERSION:
            raise ValueError(f"not a QuantReport of version {REPORT_VERSION}")
        fields = {f.name for f in dataclasses.fields(LayerDecision)}
        layers = []
        for item in data["layers"]:
            if not isinstance(item, dict) or not {"name", "kind", "shape", "decision"} <= set(item) \
                    or not set(item) <= fields or item["decision"] not in (QUANTIZE, SKIP):
                raise ValueError(f"malformed layer entry {item!r}")
            layers.append(LayerDecision(**{k: _unnum(v) if k in _NUMERIC else v for k, v in item.items()}))
        return cls(format=data["format"], device=data["device"], config=dict(data["config"]), layers=layers,
                   cache_hit=bool(data.get("cache_hit", False)), calibrated=bool(data.get("calibrated", False)),
                   cache_key=data.get("cache_key"), seconds=dict(data.get("seconds", {})))

    @classmethod
    def from_json(cls, text: str) -> "QuantReport":
        return cls.from_dict(json.loads(text))

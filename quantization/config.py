"""What to quantize and how: `QuantConfig`, validated with errors that name the problem and the fix."""
from __future__ import annotations

import dataclasses
import logging

import torch

from . import formats
from .formats import cuda_capability

log = logging.getLogger("overdrive.quantization")



@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Settings of one quantization run.

    A candidate layer (nn.Linear, nn.Conv2d) is quantized only if a low-precision kernel can run it, its
    normalised error on the real calibration inputs is below its threshold (`linear_mse_threshold` or
    `conv_mse_threshold`) AND its compute density is at least `compute_density_threshold` FLOP/byte.
    See `overdrive.quantization.metrics` for both measures.

    - bits: the bit width of the registered formats (quantization/formats/: 8 for int8 and fp8, 4 for int4 weights
      with fp8 compute). With 4, a layer whose 4-bit error is not below `int4_mse_threshold` gets the 8-bit decision.
    - format: "auto" (the best registered format of `bits` the device runs: fp8 e4m3 on NVIDIA compute capability
      >= 8.9, int8 on >= 8.0 and on the CPU; int4_fp8 for 4 bits on >= 8.9), or a registered format's name ("int8",
      "fp8_e4m3", "int4_fp8").
    - quantize_linear / quantize_conv: consider nn.Linear / nn.Conv2d layers at all.
    - linear_mse_threshold / conv_mse_threshold: largest normalised MSE (mean((y_q - y)^2) / mean(y^2)) accepted.
      0.01 means a quantization noise 20 dB below the layer's output power (SQNR >= 20 dB).
    - int4_mse_threshold: with bits 4, the largest normalised MSE a layer's 4-bit weights may add. 4 bits are for
      cards that do not hold the model in 8 bits, where every layer left in 8 bits streams from host memory at each
      call: a looser bound than 8 bits' is the one that pays there (bench/README.md, the budgets table).
    - compute_density_threshold: FLOP per byte moved (fp16) at or above which a layer counts as compute-bound
      (an H100 does ~990 dense fp16 TFLOP/s over 3.35 TB/s: the ridge point is ~300). Below it a layer is
      memory-bound: its time is reading its weight, which `weight_only` halves.
    - min_speedup: on CUDA, a layer that passes both checks is also timed (float layer against its 8-bit path at
      its real input shape, see `overdrive.quantization.speed`) and quantized only if it runs at least this many
      times faster; 0 turns the timing off (density alone then stands for speed). Not applied on the CPU.
    - calibration_tokens: input rows (tokens, or pixels of a 1x1 conv) kept per layer for measuring.
    - fp8_fast_accum: `use_fast_accum` of torch._scaled_mm (faster on Hopper; its error is measured like the rest).
    - fp8_static_activations: fp8 layers scale their inputs by a static scale from the calibration amax (with 2x
      headroom, `kernels.STATIC_HEADROOM`), so under torch.compile the cast fuses into the producing kernel; False:
      a dynamic scale per input (a reduction over every input first; no saturation possible).
    - weight_only: a memory-bound layer (below `compute_density_threshold`) whose error passes keeps its weight in
      int8 with a scale per output channel and computes in the model's precision (quantization/weight_only.py):
      half its memory, and under Compile Model half the bytes to read. On CUDA with timing on, one whose 8-bit GEMM
      measures `min_speedup` times the weight-only kernel's speed runs that GEMM instead (same storage; tens of rows,
      e.g. a text stream). False leaves such layers in float.
    """

    bits: int = 8
    format: str = "auto"
    quantize_conv: bool = True
    quantize_linear: bool = True
    conv_mse_threshold: float = 0.01
    linear_mse_threshold: float = 0.01
    int4_mse_threshold: float = 0.03
    compute_density_threshold: float = 300.0
    min_speedup: float = 1.1
    calibration_tokens: int = 256
    fp8_fast_accum: bool = True
    fp8_static_activations: bool = True
    weight_only: bool = True

    def __post_init__(self):
        self.validate()

    def validate(self) -> "QuantConfig":
        widths = formats.bit_widths()
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in widths:
            raise ValueError(f"QuantConfig.bits={self.bits!r} is not supported: Overdrive's formats quantize to "
                             f"{' or '.join(map(str, widths))} bits. Use bits={widths[-1]}.")
        if self.format not in format_names():
            raise ValueError(f"QuantConfig.format={self.format!r} is unknown. Use one of "
                             f"{', '.join(map(repr, format_names()))}.")
        if self.format != "auto" and formats.get(self.format).bits != self.bits:
            raise ValueError(f"QuantConfig.format={self.format!r} is a {formats.get(self.format).bits}-bit format, "
                             f"but bits={self.bits}. Use bits={formats.get(self.format).bits} or format='auto'.")
        for name in ("quantize_conv", "quantize_linear", "fp8_fast_accum", "fp8_static_activations", "weight_only"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"QuantConfig.{name}={getattr(self, name)!r} must be True or False.")
        for name in ("conv_mse_threshold", "linear_mse_threshold", "int4_mse_threshold", "compute_density_threshold",
                     "min_speedup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"QuantConfig.{name}={value!r} must be a number (0 or more).")
            if value < 0:
                raise ValueError(f"QuantConfig.{name}={value!r} is negative. Use 0 or more "
                                 f"(0 quantizes nothing for an error threshold; 0 accepts every layer for density).")
        if isinstance(self.calibration_tokens, bool) or not isinstance(self.calibration_tokens, int) \
                or self.calibration_tokens < 1:
            raise ValueError(f"QuantConfig.calibration_tokens={self.calibration_tokens!r} must be a whole number >= 1 "
                             f"(e.g. 256).")
        return self

    def threshold_for(self, kind: str) -> float:
        return self.linear_mse_threshold if kind == "linear" else self.conv_mse_threshold

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "QuantConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"QuantConfig has no setting(s) {unknown}; known: {sorted(known)}.")
        return cls(**data)

    def resolve_format(self, device) -> str:
        """The concrete format's name for `device`; raises if the device cannot run it."""
        device = torch.device(device)
        if self.format == "auto":
            if device.type not in ("cuda", "cpu"):
                raise ValueError(f"format='auto': quantization runs on NVIDIA GPUs and the CPU, not on "
                                 f"{device.type!r}. Leave quantization off on this device.")
            best = formats.best_supported(device, self.bits)
            if best is None:
                needs = "; ".join(f"{fmt.name} needs {fmt.hardware}" for fmt in formats.REGISTRY.values()
                                  if fmt.bits == self.bits)
                raise ValueError(f"format='auto': {describe_device(device)} has no {self.bits}-bit path that "
                                 f"Overdrive supports ({needs}). Leave quantization off on this device"
                                 + (", or use bits=8." if self.bits != 8 else "."))
            return best.name
        plugin = formats.get(self.format)
        if not plugin.supported(device):
            others = [name for name in formats.names() if name != plugin.name and formats.get(name).supported(device)]
            fix = f"Use format={others[0]!r} or format='auto'." if others else "Leave quantization off on this device."
            raise ValueError(f"format={plugin.name!r} needs {plugin.kernel}, i.e. {plugin.hardware}; "
                             f"{describe_device(device)} has none. {fix}")
        return plugin.name


def format_names() -> tuple:
    """What `format` accepts: "auto" and every registered format."""
    return ("auto",) + formats.names()


def describe_device(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            major, minor = cuda_capability(device)
            return f"this GPU ({torch.cuda.get_device_name(index)}, compute capability {major}.{minor})"
        except Exception:  # noqa: BLE001 - only a description
            return f"device {str(device)!r}"
    return f"device {str(device)!r}"


def fp8_supported(device) -> bool:
    return formats.get("fp8_e4m3").supported(device)


def int8_supported(device) -> bool:
    return formats.get("int8").supported(device)

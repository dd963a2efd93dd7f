"""What a quantization format is (`QuantFormat`) and the registry formats add themselves to."""
from __future__ import annotations

import functools
import logging

import torch

from ...core.registry import Registry

log = logging.getLogger("overdrive.quantization")
REGISTRY = Registry("quantization format")


class QuantFormat:
    """name: what QuantConfig.format says. layer: its QuantizedGemm subclass. kernel: the GEMM it runs, and
    k_multiple: that kernel's constraint on K and N. min_capability: the NVIDIA compute capability it needs, hardware:
    the same in words. auto_priority: format="auto" takes the supported format with the highest; on the CPU only among
    those with auto_on_cpu (elsewhere the CPU runs a reference kernel, for tests). probe(device): runs the kernel once
    (raises where it cannot run). Subclass for the hooks below."""

    def __init__(self, name: str, layer: type, *, kernel: str, k_multiple: int, probe, bits: int = 8,
                 min_capability=(0, 0), runs_on_cpu: bool = True, auto_priority: int = 0, auto_on_cpu: bool = False,
                 hardware: str = ""):
        self.name, self.layer, self.kernel, self.k_multiple, self.bits = name, layer, kernel, k_multiple, bits
        self.min_capability, self.runs_on_cpu, self.hardware = tuple(min_capability), runs_on_cpu, hardware
        self.auto_priority, self.auto_on_cpu, self._probe = auto_priority, auto_on_cpu, probe

    def layer_options(self, config) -> dict:
        """Keyword arguments of `layer(...)` taken from the QuantConfig."""
        return {}

    def calibrated(self, layer, input_amax, config):
        """`layer` finished with what calibration measured (e.g. a static activation scale from `input_amax`)."""
        return layer

    def compiled_call(self, layer, x):
        """A call of `layer` on `x` costing what the layer costs inside a compiled model (quantization/speed.py)."""
        return lambda: layer(x)

    def shape_problem(self, k: int, n: int) -> str | None:
        """Why the kernel cannot take a (.., K) x (K, N) product, or None when it can."""
        bad = [f"{name}={value}" for name, value in (("K", k), ("N", n)) if value % self.k_multiple]
        if bad:
            return f"{' and '.join(bad)} not a multiple of {self.k_multiple} ({self.kernel} constraint)"
        return None

    def probe(self, device) -> None:
        self._probe(torch.device(device))

    def supported(self, device) -> bool:
        device = torch.device(device)
        if device.type == "cuda":
            if cuda_capability(device) < tuple(self.min_capability):
                return False
        elif device.type != "cpu" or not self.runs_on_cpu:
            return False
        return _probed(self.name, str(device))


def cuda_capability(device) -> tuple:
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def _probed(name: str, device: str) -> bool:
    try:
        REGISTRY[name].probe(torch.device(device))
        return True
    except Exception as error:  # noqa: BLE001 - a probe: any failure means "not supported"
        log.info("Overdrive quantization: %s matmul unavailable on %s (%s)", name, device, error)
        return False


def register(fmt: QuantFormat) -> QuantFormat:
    return REGISTRY.register(fmt.name, fmt)


def get(name: str) -> QuantFormat:
    return REGISTRY.lookup(name)


def names() -> tuple:
    return tuple(REGISTRY)


def bit_widths() -> tuple:
    return tuple(sorted({fmt.bits for fmt in REGISTRY.values()}))


def best_supported(device, bits: int) -> QuantFormat | None:
    """format="auto": the supported format of `bits` with the highest priority on `device`, or None."""
    device = torch.device(device)
    usable = [fmt for fmt in REGISTRY.values() if fmt.bits == bits and fmt.supported(device)
              and (device.type != "cpu" or fmt.auto_on_cpu)]
    return max(usable, key=lambda fmt: fmt.auto_priority, default=None)

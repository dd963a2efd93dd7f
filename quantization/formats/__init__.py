"""Quantization formats as plug-ins, in torchao's style: one `QuantFormat` per file, registered by name. A format
brings its quantized linear layer (a `gemm.QuantizedGemm`) and says where it runs, which GEMM shapes its kernel
takes, and how a calibrated layer is finished and timed. The rest of quantization (calibration, measuring, the
decisions, the cache, ComfyUI's node and the diffusers API) works through this registry, so a new format (nvfp4)
is one file here plus its import line below.
"""
from .base import REGISTRY, QuantFormat, best_supported, bit_widths, cuda_capability, get, names, register  # noqa: F401
from . import int8, fp8, int4  # noqa: E402,F401,I001  (each registers itself; this order is the node's list)

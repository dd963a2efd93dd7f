"""Measured 8-bit (int8, fp8; formats are plug-ins in formats/) quantization of diffusion models (plain torch, no ComfyUI).

    from overdrive.quantization import QuantConfig, quantize_module

    report = quantize_module(unet, QuantConfig(), calibration=lambda: sample_a_few_steps(unet), cache=True)
    print(report.table())

Per layer (nn.Linear, 1x1 nn.Conv2d): quantized only where a real low-precision kernel runs it, its normalised
error on real calibration inputs is below the threshold, and its compute density says it is compute-bound.
`plan_quantization` returns the replacement modules without touching the model (for ComfyUI object patches).
"""
from .apply import QuantPlan, apply_modules, plan_quantization, quantize_module, restore_modules
from .cache import QuantCache, resolution_bucket, weights_digest
from .calibrate import Calibrator, measure_layer
from .config import QuantConfig, format_names, fp8_supported, int8_supported
from .formats import QuantFormat, register
from .metrics import conv2d_density, linear_density, normalised_mse, sqnr_db
from .modules import Fp8Linear, Int8Linear, QuantConv2d1x1, quantized_module_for
from .report import LayerDecision, QuantReport
from .weight_only import Int8WeightOnlyLinear

__all__ = [
    "QuantConfig", "format_names", "QuantFormat", "register", "quantize_module", "plan_quantization", "QuantPlan", "apply_modules", "restore_modules",
    "Calibrator", "measure_layer", "QuantCache", "weights_digest", "resolution_bucket", "QuantReport",
    "LayerDecision", "Int8Linear", "Fp8Linear", "Int8WeightOnlyLinear", "QuantConv2d1x1", "quantized_module_for",
    "normalised_mse",
    "sqnr_db", "linear_density", "conv2d_density", "fp8_supported", "int8_supported",
]

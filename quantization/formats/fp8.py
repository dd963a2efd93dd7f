"""fp8 e4m3: one weight scale and one activation scale per tensor, `torch._scaled_mm` (NVIDIA compute capability
8.9+: Ada, Hopper, Blackwell; the CPU runs torch's reference kernel). The activation scale is static (from the
calibration amax, so under torch.compile the cast fuses into the kernel that produces the input) or dynamic."""
from __future__ import annotations

import torch

from .. import kernels
from ..gemm import QuantizedGemm
from .base import QuantFormat, register


class Fp8Linear(QuantizedGemm):
    """fp8 e4m3 linear: one weight scale and one activation scale per tensor, `torch._scaled_mm` (bias and output
    cast fused into the GEMM). The activation scale is static (`input_scale`, set from the calibration amax with
    `set_input_amax`) or, until one is set, dynamic (each input's own amax)."""

    format = "fp8_e4m3"
    storage_dtype = kernels.FP8_DTYPE
    per_channel_scales = False

    def __init__(self, in_features, out_features, bias=True, device=None, fast_accum: bool = True):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.fast_accum = bool(fast_accum)
        self.register_buffer("input_scale", None)
        self.register_buffer("input_scale_inverse", None, persistent=False)  # what the input's cast multiplies by
        # Set by `fuse_gelu_into` (quantization/gelu_fusion.py) on an MLP's first layer: its output goes through
        # tanh-GELU into a static fp8 layer, whose input scale this copies; inputs of `gelu_dtype` take the fused path.
        self.register_buffer("gelu_output_scale_inverse", None, persistent=False)
        self.gelu_dtype = None
        self.e4m3_input_dtype = None  # on that second layer: its output dtype when its input arrives in e4m3

    @property
    def static_input(self) -> bool:
        return self.input_scale is not None

    @torch.no_grad()
    def set_input_amax(self, amax: torch.Tensor) -> "Fp8Linear":
        """Use a static activation scale for inputs whose largest magnitude in calibration was `amax`."""
        self.load_input_scale(kernels.static_fp8_scale(amax.to(self.weight_q.device)))
        return self

    @torch.no_grad()
    def load_input_scale(self, input_scale: torch.Tensor | None):
        if input_scale is None:
            return
        if input_scale.numel() != 1:
            raise ValueError(f"Fp8Linear: a static input scale is one number, not {tuple(input_scale.shape)}.")
        scale = input_scale.detach().float().reshape(1, 1).to(self.weight_q.device)
        if self.input_scale is None:
            self.input_scale, self.input_scale_inverse = scale.clone(), 1.0 / scale
        else:  # in place: a compiled graph that captured the buffers sees the new values
            self.input_scale.copy_(scale)
            self.input_scale_inverse.copy_(1.0 / scale)

    @torch.no_grad()
    def fuse_gelu_into(self, consumer: "Fp8Linear", dtype: torch.dtype) -> "Fp8Linear":
        """This layer's output goes through tanh-GELU into `consumer` (both static fp8 layers): from now on inputs of
        `dtype` get one kernel that writes `consumer`'s e4m3 input, GELU applied, and `consumer` takes that input as
        it comes (its output in `dtype`). The GELU between must then pass e4m3 through (gelu_fusion.py does both)."""
        if not (self.static_input and consumer.static_input):
            raise ValueError("Fp8Linear.fuse_gelu_into: both layers need static input scales (set_input_amax).")
        inverse = consumer.input_scale_inverse.detach().to(self.weight_q.device)
        if self.gelu_output_scale_inverse is None:
            self.gelu_output_scale_inverse = inverse.clone()
        else:
            self.gelu_output_scale_inverse.copy_(inverse)
        self.gelu_dtype, consumer.e4m3_input_dtype = dtype, dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x2d = x.shape, x.reshape(-1, self.in_features)
        if x.dtype == kernels.FP8_DTYPE:  # the fused first layer's output, already at this layer's input scale
            y = self.gemm_quantized(x2d, self.e4m3_input_dtype)
        elif x.dtype == self.gelu_dtype:
            y = kernels.fp8_linear_gelu(x2d, self.weight_q, self.weight_scale, self.bias, self.input_scale,
                                        self.input_scale_inverse, self.gelu_output_scale_inverse, self.fast_accum)
        else:
            y = self.gemm(x2d, x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def quantized_state(self) -> dict:
        state = super().quantized_state()
        if self.input_scale is not None:
            state["input_scale"] = self.input_scale
        return state

    def quantize_weight(self, weight):
        return kernels.quantize_weight_fp8(weight)

    def gemm(self, x2d, out_dtype):
        return kernels.fp8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype, self.fast_accum,
                                  self.input_scale, self.input_scale_inverse)

    def gemm_quantized(self, xq, out_dtype):
        """The GEMM alone on an input already cast with the static scale (what is left of `gemm` once torch.compile
        has fused the cast into the input's producer; speed.py times it)."""
        return kernels.fp8_gemm(xq, self.input_scale, self.weight_q, self.weight_scale, self.bias, out_dtype,
                                self.fast_accum)

    def reference_gemm(self, x2d, out_dtype):
        return kernels.reference_fp8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype,
                                            self.input_scale)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation scale={'static' if self.static_input else 'dynamic'}"


class Fp8E4m3(QuantFormat):
    """Its layers take `fp8_fast_accum` and a static activation scale from calibration, and are timed as they run
    under compile."""

    def __init__(self):
        super().__init__("fp8_e4m3", Fp8Linear, kernel="torch._scaled_mm", k_multiple=16, probe=self._run_scaled_mm,
                         min_capability=(8, 9), auto_priority=2,
                         hardware="an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)")

    def layer_options(self, config) -> dict:
        return {"fast_accum": config.fp8_fast_accum}

    def calibrated(self, layer, input_amax, config):
        if input_amax is not None and config.fp8_static_activations:
            layer.set_input_amax(input_amax)
        return layer

    def compiled_call(self, layer, x):
        if not (isinstance(layer, Fp8Linear) and layer.static_input):  # a 1x1 conv's wrapper is timed whole
            return super().compiled_call(layer, x)
        # Under torch.compile the static cast fuses into the input's producer: only the GEMM is left to time.
        xq = kernels.quantize_tensor_fp8_static(x.reshape(-1, layer.in_features), layer.input_scale_inverse)
        return lambda: layer.gemm_quantized(xq, x.dtype)

    @staticmethod
    def _run_scaled_mm(device):
        a = torch.zeros(32, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.zeros(32, 32, device=device).to(torch.float8_e4m3fn).t()
        torch._scaled_mm(a, b, torch.ones(32, 1, device=device), torch.ones(1, 32, device=device),
                         out_dtype=torch.bfloat16)


register(Fp8E4m3())

"""Drop-in quantized replacements for nn.Linear and 1x1 nn.Conv2d, running real int8 / fp8 GEMMs.

- `Int8Linear`: W8A8, `torch._int_mm` (runs on CUDA sm80+ and on the CPU).
- `Fp8Linear`: e4m3 weights and activations, one scale per tensor (the activation's static, from calibration, or
  dynamic), `torch._scaled_mm` (CUDA sm89+; CPU too).
- `QuantConv2d1x1`: a 1x1 / stride 1 / ungrouped conv as a GEMM over pixels (NCHW -> rows of channels) through
  one of the two linears above.

Every module keeps its quantized weight, its scales (per channel for int8, per tensor for fp8) and the float bias
as buffers whose dtypes never change (`model.half()` or `.to(dtype)` moves them between devices but does not cast
them), and can be re-quantized in place from a new float weight (`load_float_weight`) without re-measuring: the
buffers are overwritten, so a compiled graph that captured them keeps working (weight switching).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import kernels


class _QuantizedGemm(nn.Module):
    """Shared body of the quantized linears: buffers, in-place re-quantization, dtype-preserving `_apply`."""

    format: str = ""
    storage_dtype: torch.dtype = torch.int8
    per_channel_scales: bool = True  # weight_scale is (1, N); else (1, 1)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.register_buffer("weight_q", torch.zeros(self.out_features, self.in_features, dtype=self.storage_dtype,
                                                     device=device))
        scales = self.out_features if self.per_channel_scales else 1
        self.register_buffer("weight_scale", torch.ones(1, scales, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(self.out_features, dtype=torch.float32, device=device))
        else:
            self.register_buffer("bias", None)

    # -- construction / weight switching -------------------------------------------------------------------
    @classmethod
    def from_float(cls, module_or_weight, bias=None, **kwargs):
        """From an nn.Linear (or a (N, K[, 1, 1]) weight and optional bias): quantized on the weight's device."""
        if isinstance(module_or_weight, nn.Module):
            weight, bias = module_or_weight.weight, module_or_weight.bias
        else:
            weight = module_or_weight
        weight = weight.detach().reshape(weight.shape[0], -1)
        module = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, **kwargs)
        module.load_float_weight(weight, bias)
        return module

    def quantize_weight(self, weight: torch.Tensor):
        raise NotImplementedError

    @torch.no_grad()
    def load_float_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "_QuantizedGemm":
        """Re-quantize in place from a new float weight ((N, K), or (N, K, 1, 1) for a 1x1 conv) and bias."""
        weight = weight.detach()
        if weight.dim() != 2:
            weight = weight.reshape(weight.shape[0], -1)
        if tuple(weight.shape) != tuple(self.weight_q.shape):
            raise ValueError(f"{type(self).__name__}.load_float_weight: weight of shape {tuple(weight.shape)} does not "
                             f"fit this layer ({self.out_features} x {self.in_features}); pass the weight of the same "
                             f"layer from a checkpoint of the same architecture.")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{type(self).__name__}.load_float_weight: the layer was built "
                             f"{'without' if self.bias is None else 'with'} a bias; pass "
                             f"{'bias=None' if self.bias is None else 'its bias'}.")
        q, scale = self.quantize_weight(weight.to(self.weight_q.device))
        self.load_quantized(q, scale, bias)
        return self

    @torch.no_grad()
    def load_quantized(self, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        """Copy already quantized tensors (e.g. from the on-disk cache) into this module's buffers."""
        if weight_q.dtype != self.storage_dtype or tuple(weight_q.shape) != tuple(self.weight_q.shape):
            raise ValueError(f"{type(self).__name__}: quantized weight {tuple(weight_q.shape)} {weight_q.dtype} does "
                             f"not fit {tuple(self.weight_q.shape)} {self.storage_dtype}.")
        if weight_scale.numel() != self.weight_scale.numel():
            raise ValueError(f"{type(self).__name__}: {weight_scale.numel()} weight scales do not fit this layer's "
                             f"{self.weight_scale.numel()}.")
        self.weight_q.copy_(weight_q)
        self.weight_scale.copy_(weight_scale.reshape(1, -1))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias.detach().reshape(-1))
        return self

    def quantized_state(self) -> dict:
        state = {"weight_q": self.weight_q, "weight_scale": self.weight_scale}
        if self.bias is not None:
            state["bias"] = self.bias
        return state

    def load_input_scale(self, input_scale: torch.Tensor | None):
        """Static activation scale from the cache (only fp8 layers have one)."""
        if input_scale is not None:
            raise ValueError(f"{type(self).__name__} takes no static input scale.")

    def _apply(self, fn, recurse=True):
        # Quantized storage keeps its dtype under model.half()/.to(dtype): only the device follows `fn`.
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)
            self._buffers[name] = moved
        return self

    # -- compute ---------------------------------------------------------------------------------------------
    def gemm(self, x2d: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def reference_gemm(self, x2d: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.gemm(x.reshape(-1, self.in_features), x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul oracle (CPU tests only)."""
        shape = x.shape
        y = self.reference_gemm(x.reshape(-1, self.in_features), x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(_QuantizedGemm):
    """W8A8 linear: int8 per-output-channel weights, per-token dynamic int8 activations, `torch._int_mm`."""

    format = "int8"
    storage_dtype = torch.int8

    def quantize_weight(self, weight):
        return kernels.quantize_weight_int8(weight)

    def gemm(self, x2d, out_dtype):
        return kernels.int8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype)

    def reference_gemm(self, x2d, out_dtype):
        return kernels.reference_int8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype)


class Fp8Linear(_QuantizedGemm):
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
            self.input_scale = scale.clone()
        else:  # in place: a compiled graph that captured the buffer sees the new value
            self.input_scale.copy_(scale)

    def quantized_state(self) -> dict:
        state = super().quantized_state()
        if self.input_scale is not None:
            state["input_scale"] = self.input_scale
        return state

    def quantize_weight(self, weight):
        return kernels.quantize_weight_fp8(weight)

    def gemm(self, x2d, out_dtype):
        return kernels.fp8_linear(x2d, self.weight_q, self.weight_scale, self.bias, out_dtype, self.fast_accum,
                                  self.input_scale)

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


GEMM_CLASSES = {"int8": Int8Linear, "fp8_e4m3": Fp8Linear}


class QuantConv2d1x1(nn.Module):
    """A 1x1 conv (stride 1, no padding, one group) as a GEMM over pixels through a quantized linear `gemm`.

    The output has the input's memory format (NCHW-contiguous in, NCHW-contiguous out; channels-last in,
    channels-last out), as nn.Conv2d would.
    """

    def __init__(self, gemm: _QuantizedGemm):
        super().__init__()
        self.gemm = gemm
        self.in_channels = gemm.in_features
        self.out_channels = gemm.out_features

    @classmethod
    def from_float(cls, conv: nn.Conv2d, fmt: str, **kwargs):
        return cls(GEMM_CLASSES[fmt].from_float(conv.weight, conv.bias, **kwargs))

    @property
    def format(self) -> str:
        return self.gemm.format

    def load_float_weight(self, weight, bias=None):
        self.gemm.load_float_weight(weight, bias)
        return self

    def quantized_state(self) -> dict:
        return self.gemm.quantized_state()

    def load_quantized(self, weight_q, weight_scale, bias=None):
        self.gemm.load_quantized(weight_q, weight_scale, bias)
        return self

    def load_input_scale(self, input_scale):
        self.gemm.load_input_scale(input_scale)

    def set_input_amax(self, amax):
        self.gemm.set_input_amax(amax)
        return self

    def _run(self, x, gemm_fn):
        unbatched = x.dim() == 3
        if unbatched:
            x = x.unsqueeze(0)
        b, c, h, w = x.shape
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        y = gemm_fn(rows, x.dtype).reshape(b, h, w, self.out_channels).permute(0, 3, 1, 2)
        y = y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return y.squeeze(0) if unbatched else y

    def forward(self, x):
        return self._run(x, self.gemm.gemm)

    def reference_forward(self, x):
        return self._run(x, self.gemm.reference_gemm)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size=(1, 1), format={self.format}"


def quantized_module_for(module: nn.Module, fmt: str, fast_accum: bool = True, device=None,
                         input_amax: torch.Tensor | None = None) -> nn.Module:
    """The quantized replacement of an nn.Linear or 1x1 nn.Conv2d, on `device` (default: the weight's device);
    an fp8 one with a static activation scale when `input_amax` (the calibration inputs' largest magnitude) is
    given."""
    kwargs = {"fast_accum": fast_accum} if fmt == "fp8_e4m3" else {}
    weight, bias = module.weight, module.bias
    if device is not None:
        weight = weight.to(device)
        bias = None if bias is None else bias.to(device)
    if isinstance(module, nn.Linear):
        quantized = GEMM_CLASSES[fmt].from_float(weight, bias, **kwargs)
    elif isinstance(module, nn.Conv2d):
        quantized = QuantConv2d1x1(GEMM_CLASSES[fmt].from_float(weight, bias, **kwargs))
    else:
        raise TypeError(f"no quantized replacement for {type(module).__name__}")
    if input_amax is not None and fmt == "fp8_e4m3":
        quantized.set_input_amax(input_amax)
    return quantized


def build_empty(kind: str, fmt: str, in_features: int, out_features: int, bias: bool, device=None,
                fast_accum: bool = True) -> nn.Module:
    """An unfilled quantized module of the given kind, to receive cached quantized tensors."""
    kwargs = {"fast_accum": fast_accum} if fmt == "fp8_e4m3" else {}
    gemm = GEMM_CLASSES[fmt](in_features, out_features, bias=bias, device=device, **kwargs)
    return gemm if kind == "linear" else QuantConv2d1x1(gemm)

"""The base of every quantized linear layer a format plug-in provides (quantization/formats/): buffers whose dtypes
never change (`model.half()` or `.to(dtype)` moves them between devices but does not cast them), re-quantization in
place from a new float weight (`load_float_weight`, without re-measuring: the buffers are overwritten, so a compiled
graph that captured them keeps working through weight switching), and the cache's quantized state.
A format's layer sets `format`, `storage_dtype`, `per_channel_scales` (and `quantized_names`, `storage_shape` where it
stores more tensors or packs values) and implements `quantize_weight`, `gemm` and `reference_gemm`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .linear_layers import float_weight


class QuantizedGemm(nn.Module):
    """Shared body of the quantized linears: buffers, in-place re-quantization, dtype-preserving `_apply`."""

    format: str = ""
    storage_dtype: torch.dtype = torch.int8
    per_channel_scales: bool = True  # weight_scale is (1, N); else (1, 1)
    quantized_names = ("weight_q", "weight_scale")  # what `quantize_weight` returns, in order: buffers of this layer

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None):
        super().__init__()
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.register_buffer("weight_q", torch.zeros(self.storage_shape(), dtype=self.storage_dtype, device=device))
        scales = self.out_features if self.per_channel_scales else 1
        self.register_buffer("weight_scale", torch.ones(1, scales, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(self.out_features, dtype=torch.float32, device=device))
        else:
            self.register_buffer("bias", None)

    def storage_shape(self) -> tuple:
        """The shape of `weight_q` (a format that packs values sets its own)."""
        return (self.out_features, self.in_features)

    # -- construction / weight switching -------------------------------------------------------------------
    @classmethod
    def from_float(cls, module_or_weight, bias=None, **kwargs):
        """From an nn.Linear (or a (N, K[, 1, 1]) weight and optional bias): quantized on the weight's device."""
        if isinstance(module_or_weight, nn.Module):
            weight, bias = float_weight(module_or_weight), module_or_weight.bias
        else:
            weight = module_or_weight
        weight = weight.detach().reshape(weight.shape[0], -1)
        module = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, **kwargs)
        module.load_float_weight(weight, bias)
        return module

    def quantize_weight(self, weight: torch.Tensor) -> tuple:
        """The tensors of `quantized_names` for a float (N, K) weight."""
        raise NotImplementedError

    @torch.no_grad()
    def load_float_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          quantize_on: torch.device | None = None) -> "QuantizedGemm":
        """Re-quantize in place from a new float weight ((N, K), or (N, K, 1, 1) for a 1x1 conv) and bias, on
        `quantize_on` (default: where this layer is; a GPU quantizes a layer kept on the host far sooner than the
        host does)."""
        weight = weight.detach()
        if weight.dim() != 2:
            weight = weight.reshape(weight.shape[0], -1)
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{type(self).__name__}.load_float_weight: weight of shape {tuple(weight.shape)} does not "
                             f"fit this layer ({self.out_features} x {self.in_features}); pass the weight of the same "
                             f"layer from a checkpoint of the same architecture.")
        if (bias is None) != (self.bias is None):
            raise ValueError(f"{type(self).__name__}.load_float_weight: the layer was built "
                             f"{'without' if self.bias is None else 'with'} a bias; pass "
                             f"{'bias=None' if self.bias is None else 'its bias'}.")
        tensors = self.quantize_weight(weight.to(quantize_on or self.weight_q.device))
        return self.load_quantized_state({**dict(zip(self.quantized_names, tensors)), "bias": bias})

    @torch.no_grad()
    def load_quantized_state(self, state: dict) -> "QuantizedGemm":
        """Copy `quantized_state()`'s tensors (e.g. from the on-disk cache) into this module's buffers, in place."""
        for name in self.quantized_names:
            tensor, buffer = state[name], self._buffers[name]
            if tensor.dtype != buffer.dtype or tensor.numel() != buffer.numel() or (
                    name == "weight_q" and tuple(tensor.shape) != tuple(buffer.shape)):
                raise ValueError(f"{type(self).__name__}: quantized {name} {tuple(tensor.shape)} {tensor.dtype} does "
                                 f"not fit {tuple(buffer.shape)} {buffer.dtype}.")
        for name in self.quantized_names:
            self._buffers[name].copy_(state[name].reshape(self._buffers[name].shape))
        if self.bias is not None and state.get("bias") is not None:
            self.bias.copy_(state["bias"].detach().reshape(-1))
        self.load_input_scale(state.get("input_scale"))
        return self

    def quantized_state(self) -> dict:
        state = {name: self._buffers[name] for name in self.quantized_names}
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

    @property
    def weight(self) -> torch.Tensor:
        """The quantized storage, read-only. ComfyUI's model code reads `linear.weight` to choose its own kernels
        (comfy.ops.linear_input_act: Wan's and LTX's feed-forwards); storage that is not ComfyUI's QuantizedTensor
        makes it call this layer as any other module."""
        return self.weight_q

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

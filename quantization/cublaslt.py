"""cuBLASLt's fp8 GEMM with its GELU epilogue, writing e4m3: the first GEMM of a DiT MLP (fc1 -> tanh-GELU -> fc2)
in one kernel, through ctypes on the cuBLASLt library torch already loaded.

`torch._scaled_mm` has no activation epilogue, so a quantized MLP otherwise writes fc1's output in bf16 and a fused
Inductor kernel reads it back for GELU and fc2's e4m3 cast, a large share of Qwen-Image's fp8 image
(bench/experiments/fp8-against-compile-model.md). cuBLASLt computes D = scale_d * GELU(scale_a * scale_b * A B + bias)
and converts D to e4m3 in the epilogue (Transformer Engine fuses its fp8 MLPs the same way); its GELU is the tanh
form, which DiT MLPs use.

Row-major y (M, N) = x (M, K) @ W^T, W (N, K), is column-major y^T = W x^T: A = W (transposed), B = x, D = y, the "TN"
layout Hopper's fp8 kernels require. Descriptors and the heuristic's algorithm are built once per problem; each call
sets the data pointers and runs one cublasLtMatmul on torch's current stream (capturable in a CUDA graph: the
workspace comes from torch's allocator).
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

import torch

from ..core.errors import OverdriveError

# cublasLt.h / cublas_api.h / library_types.h (CUDA 12 and 13 agree on these values)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF, _R_8F_E4M3 = 0, 2, 14, 28
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_A_SCALE, _DESC_B_SCALE, _DESC_D_SCALE, _DESC_FAST_ACCUM, _DESC_BIAS_TYPE = 17, 18, 20, 25, 26
_EPILOGUE_BIAS, _EPILOGUE_GELU = 4, 32
_PREF_MAX_WORKSPACE = 1
WORKSPACE_BYTES = 32 * 1024 * 1024  # cuBLAS's recommendation for Hopper
_DATA_TYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}


class CublasLtError(OverdriveError, RuntimeError):
    pass


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library_candidates():
    yield "libcublasLt.so.13"  # torch's CUDA build has loaded one of these already: dlopen finds it by its soname
    yield "libcublasLt.so.12"
    site = os.path.dirname(os.path.dirname(torch.__file__))  # else the nvidia-cublas wheel beside torch
    yield from sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcublasLt.so*")))


class _Library:
    def __init__(self):
        errors = []
        for name in _library_candidates():
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as error:
                errors.append(str(error))
        else:
            raise CublasLtError(f"cuBLASLt library not found ({'; '.join(errors[-2:])})")
        lib, p, i, sz = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        signatures = {
            "cublasLtCreate": [ctypes.POINTER(p)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i, i],
            "cublasLtMatmulDescSetAttribute": [p, i, p, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
            "cublasLtMatmulPreferenceSetAttribute": [p, i, p, sz],
            "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i)],
            "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, sz, p],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, i
        self.handles = {}

    def handle(self, device: torch.device):
        """One cuBLASLt handle per GPU, created with that GPU current (the library's state is per device)."""
        if device.index not in self.handles:
            handle = ctypes.c_void_p()
            with torch.cuda.device(device):
                self.check(self.lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            self.handles[device.index] = handle
        return self.handles[device.index]

    @staticmethod
    def check(status: int, what: str):
        if status != 0:
            raise CublasLtError(f"{what} returned cuBLAS status {status}")


_state = {"library": None, "plans": {}}
_lock = threading.Lock()


def _library() -> _Library:
    with _lock:
        if _state["library"] is None:
            _state["library"] = _Library()
        return _state["library"]


class _Plan:
    """Descriptors and the chosen algorithm of one fp8 GEMM + GELU problem (M, N, K, bias type, fast accumulation),
    kept for the process. A call sets the data pointers on the shared descriptor, hence the lock."""

    def __init__(self, lib: _Library, device: torch.device, m: int, n: int, k: int, bias_type: int | None,
                 fast_accum: bool):
        c, p = ctypes, ctypes.c_void_p
        self.lib, self.handle, self.desc, self.lock = lib, lib.handle(device), p(), threading.Lock()
        check = lib.check
        check(lib.lib.cublasLtMatmulDescCreate(c.byref(self.desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
        self._set(_DESC_TRANSA, c.c_int32(_OP_T))
        self._set(_DESC_TRANSB, c.c_int32(_OP_N))
        self._set(_DESC_EPILOGUE, c.c_int32(_EPILOGUE_GELU | (0 if bias_type is None else _EPILOGUE_BIAS)))
        if bias_type is not None:
            self._set(_DESC_BIAS_TYPE, c.c_int32(bias_type))
        self._set(_DESC_FAST_ACCUM, c.c_int8(1 if fast_accum else 0))
        self.a, self.b, self.c, self.d = p(), p(), p(), p()
        for layout, dtype, rows, cols in ((self.a, _R_8F_E4M3, k, n), (self.b, _R_8F_E4M3, k, m),
                                          (self.c, bias_type or _R_16BF, n, m), (self.d, _R_8F_E4M3, n, m)):
            check(lib.lib.cublasLtMatrixLayoutCreate(c.byref(layout), dtype, rows, cols, rows),
                  "cublasLtMatrixLayoutCreate")
        preference = p()
        check(lib.lib.cublasLtMatmulPreferenceCreate(c.byref(preference)), "cublasLtMatmulPreferenceCreate")
        workspace = c.c_uint64(WORKSPACE_BYTES)
        check(lib.lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE, c.byref(workspace),
                                                           c.sizeof(workspace)), "cublasLtMatmulPreferenceSetAttribute")
        self.result, found = _HeuristicResult(), c.c_int(0)
        check(lib.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.d,
                                                     preference, 1, c.byref(self.result), c.byref(found)),
              "cublasLtMatmulAlgoGetHeuristic")
        if found.value < 1:
            raise CublasLtError(f"cuBLASLt has no fp8 GEMM + GELU kernel for M={m}, N={n}, K={k}")
        self.workspace_bytes = max(int(self.result.workspaceSize), 1)

    def _set(self, attribute: int, value):
        self.lib.check(self.lib.lib.cublasLtMatmulDescSetAttribute(self.desc, attribute, ctypes.byref(value),
                                                                   ctypes.sizeof(value)),
                       f"cublasLtMatmulDescSetAttribute({attribute})")

    def run(self, x, w, x_scale, w_scale, bias, out_scale_inverse, out):
        with self.lock:
            self._run(x, w, x_scale, w_scale, bias, out_scale_inverse, out)

    def _run(self, x, w, x_scale, w_scale, bias, out_scale_inverse, out):
        c = ctypes
        for attribute, tensor in ((_DESC_A_SCALE, w_scale), (_DESC_B_SCALE, x_scale),
                                  (_DESC_D_SCALE, out_scale_inverse)):
            self._set(attribute, c.c_void_p(tensor.data_ptr()))
        if bias is not None:
            self._set(_DESC_BIAS_POINTER, c.c_void_p(bias.data_ptr()))
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=out.device)
        alpha, beta = c.c_float(1.0), c.c_float(0.0)
        stream = c.c_void_p(torch.cuda.current_stream(out.device).cuda_stream)
        # beta = 0: C is never read, so none is passed (D's own address would mean "in place", which cuBLASLt refuses
        # with status 7 for a bf16 C beside an e4m3 D: bench/results/2026-11-28_h100_fp8_gelu_gemm.json).
        self.lib.check(self.lib.lib.cublasLtMatmul(
            self.handle, self.desc, c.byref(alpha), c.c_void_p(w.data_ptr()), self.a, c.c_void_p(x.data_ptr()),
            self.b, c.byref(beta), None, self.c, c.c_void_p(out.data_ptr()), self.d,
            c.byref(self.result.algo), c.c_void_p(workspace.data_ptr()), self.workspace_bytes, stream),
            "cublasLtMatmul")


def fp8_gemm_gelu(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_scale_inverse: torch.Tensor, fast_accum: bool = True) -> torch.Tensor:
    """e4m3 (M, N) = saturate(tanh-GELU(x @ w^T * x_scale * w_scale + bias) * out_scale_inverse).

    x: (M, K) e4m3, row-major; w: (N, K) e4m3, row-major; scales: float32 one-element tensors on the GPU; bias: (N,)
    bf16/fp16 or None. K and N must be multiples of 16 (as for torch._scaled_mm)."""
    m, k = x.shape
    n = w.shape[0]
    bias_type = None if bias is None else _DATA_TYPES[bias.dtype]
    key = (m, n, k, bias_type, bool(fast_accum), x.device.index)
    plan = _state["plans"].get(key)
    if plan is None:
        plan = _state["plans"][key] = _Plan(_library(), x.device, m, n, k, bias_type, fast_accum)
    out = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=x.device)
    plan.run(x.contiguous(), w.contiguous(), x_scale, w_scale, bias, out_scale_inverse, out)
    return out

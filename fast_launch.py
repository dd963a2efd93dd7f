"""Launching Overdrive's own Triton kernels with less host time than `kernel[grid](...)`.

Triton's launch binds and specializes every argument and builds a cache key at each call. Inside a DiT block, whose
host work must stay ahead of ~1 ms of GPU work, Overdrive launches a few kernels of its own (cuDNN fp8 attention's
casts and output, the weight-only layers): 5,100 launches per Flux image, each ~74 us under cProfile, 26 us of it the
launch itself (`bench/results/logs/flux_1024_cudnn_attention_cprofile_h100.log`).

`FastLaunch(kernel)[grid](*args, **constexprs_and_options)` launches through Triton the first time for a key, keeps
the compiled kernel that launch returns, and later launches it directly. The key holds everything Triton specializes
on: each tensor's dtype and 16-byte alignment, each integer's being 1, a multiple of 16 or wider than 32 bits, the
keyword values (constexprs, warps, stages). A launch the compiled kernel refuses (another Triton's calling convention)
turns the shortcut off for that kernel; Triton's interpreter returns no compiled kernel, so nothing is kept there.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("overdrive")


def _arg_key(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31
    if isinstance(value, float):
        return float
    if isinstance(value, tuple):
        return tuple(_arg_key(item) for item in value)
    return type(value), value


class FastLaunch:
    def __init__(self, kernel):
        self.kernel = kernel
        self.params = list(kernel.arg_names)  # the kernel's parameters in order, constexprs included
        self.compiled: dict = {}
        self.enabled = True

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        key = (tuple(_arg_key(a) for a in args), tuple(kwargs.items()))
        compiled = self.compiled.get(key) if self.enabled else None
        if compiled is not None:
            try:
                values = (*args, *(kwargs[name] for name in self.params[len(args):]))
                compiled[grid](*values)
                return
            except Exception as error:  # noqa: BLE001 - another calling convention: Triton's own launch from now on
                self.enabled = False
                log.warning("Overdrive: launching %s directly failed (%s); using Triton's launch.",
                            getattr(self.kernel, "__name__", self.kernel), error)
        compiled = self.kernel[grid](*args, **kwargs)
        if self.enabled and hasattr(compiled, "__getitem__"):
            self.compiled[key] = compiled

"""Overdrive's attention for code that calls torch's SDPA directly (diffusers' attention processors, directly or
through its "native" attention backend): a TorchFunctionMode, entered around a model's forward, that sends the SDPA
calls the op takes (no mask, no dropout, not causal, the default scale) to `torch.ops.overdrive.attention` and every
other call to SDPA itself. torch.compile traces the mode, so compiled code calls the custom op."""
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .choice import AttentionConfig, OnePerConfig
from .op import attend, fits

SDPA_ARGUMENTS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class RoutedSDPA(OnePerConfig, TorchFunctionMode):
    """The mode (compiled code guards on the mode stack: one instance per settings)."""

    def __init__(self, config: AttentionConfig):
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            qkv = routable(args, kwargs)
            if qkv is not None:
                out = attend(*qkv, self.config)
                return out.transpose(1, 2)  # SDPA's layout: (batch, heads, tokens, head dim)
        return func(*args, **kwargs)


def routable(args, kwargs):
    """(q, k, v) of an SDPA call the op takes (a layout it reads, no option it lacks), else None. Positional or
    keyword: diffusers' native backend passes them all by name. (A module-level function: Dynamo cannot guard on a
    staticmethod of a mode.)"""
    given = dict(zip(("query", "key", "value", *SDPA_ARGUMENTS), args), **kwargs)
    q, k, v = (given.get(name) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not fits(q, k, v):
        return None
    scale = given.get("scale")
    if (given.get("attn_mask") is not None or given.get("dropout_p") or given.get("is_causal")
            or given.get("enable_gqa")
            or not (scale is None or math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6))):
        return None
    return q, k, v


class RoutedForward:
    """A model's forward run inside RoutedSDPA. `inner`: the forward it wraps (compiled, step-cached), None for the
    module's own; that forward's attributes (a step cache's statistics) read through."""

    overdrive_stack = None  # set by stack.build
    wraps_forward = True

    def __init__(self, module, inner, config: AttentionConfig):
        self.module, self.inner, self.mode = module, inner, RoutedSDPA(config)

    def __call__(self, *args, **kwargs):
        with self.mode:
            if self.inner is None:
                return type(self.module).forward(self.module, *args, **kwargs)
            return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


def unwrapped(forward):
    """The forward inside Overdrive's wrappers (this routing, a split over processes); itself otherwise."""
    while getattr(type(forward), "wraps_forward", False):
        forward = forward.inner
    return forward

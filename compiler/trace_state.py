"""What Overdrive's compiler is tracing now, for code that traces differently by it (attention/e4m3_output.py), read
without a guard so that the answer is baked into the graph and never recompiles it. (Inside a trace, Dynamo answers
`type(size) is int` for a symbolic size too, so traced code cannot tell by itself.)"""
import contextlib

import torch

_static_shapes = False


@contextlib.contextmanager
def tracing_static_shapes(static: bool):
    """Around a compiled call (shared_graph.py): whether a trace it starts has static sizes only (a precompiled
    frame's capture, torch.compile's first trace of a graph). Other traces may have symbolic sizes (Dynamo's automatic
    dynamic, the `dynamic` policy), which code that looks sizes up cannot take as constants."""
    global _static_shapes
    saved, _static_shapes = _static_shapes, static
    try:
        yield
    finally:
        _static_shapes = saved


@torch.compiler.assume_constant_result
def static_shapes() -> bool:
    return _static_shapes

"""`torch.ops.overdrive.attention`: attention through the per-shape choice, as one custom op, so that torch.compile
traces it as a single opaque call (with a fake implementation for shapes) and CUDA graphs record it like any kernel.
The backend is picked inside the op at run time; under torch.compile the surrounding graph does not change with it,
except where cuDNN's fp8 graph hands its e4m3 output to the graph (`attend`, e4m3_output.py).
"""
import torch

from ..core.cuda_streams import capturing, out_of_memory
from . import e4m3_output
from .choice import BACKENDS, CHOOSER, AttentionConfig, sdpa


@torch.library.custom_op("overdrive::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, max_error: float) -> torch.Tensor:
    """(batch, heads, tokens, head dim) q, k, v -> (batch, tokens, heads, head dim), contiguous."""
    config = AttentionConfig(mode, max_error)
    backend = CHOOSER.backend(q, k, v, config)
    if backend != "sdpa":
        try:
            return BACKENDS[backend].run(q, k, v)
        except Exception as error:  # noqa: BLE001 - a generation never fails because of an optimization
            if capturing():
                raise  # SDPA inside an invalidated capture fails too: the recorder runs the block without a graph
            if not out_of_memory(error):  # the card's state at this call, not the backend's fault: kept for the next
                CHOOSER.failed(q, k, v, config, backend, error)
    return sdpa(q, k, v)


@attention.register_fake
def _(q, k, v, mode, max_error):
    batch, heads, tokens, dim = q.shape
    return q.new_empty((batch, tokens, heads, v.shape[-1]))


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether (batch, heads, tokens, head dim) q, k, v are a layout the op takes: one batch and head count, as many
    values as keys, the head dim contiguous."""
    return (q.ndim == k.ndim == v.ndim == 4 and k.shape[:2] == q.shape[:2] and v.shape[:3] == k.shape[:3]
            and all(t.stride(-1) == 1 for t in (q, k, v)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: AttentionConfig) -> torch.Tensor:
    """What Overdrive's attention entry points call: the op, or, in a block traced at a shape the chooser gave to
    cuDNN's fp8 graph, that graph with its e4m3 output dequantized in the compiled code (e4m3_output.py)."""
    if e4m3_output.applies(q, k, config):
        return e4m3_output.attention(q, k, v)
    return attention(q, k, v, config.mode, config.max_error)

"""ComfyUI functions that torch.compile cannot trace, given a traceable path to the same arithmetic while it traces;
eager calls keep ComfyUI's own.

- `comfy.ops.linear_input_act(linear, x, act)` (Wan's and LTX's feed-forwards): on an INT8 layer (an int8 / convrot
  checkpoint) it calls comfy-kitchen's fused quantizer, which reads the current CUDA stream's handle; Dynamo hands it
  a `torch.Stream` without one, so every compiled block over such a layer failed and ran eager. While tracing, the
  layer is called on `act(x)`: its weight reaches the same INT8 GEMM through kitchen's registered op, the activation
  applied before it as kitchen's unfused path does.
"""
import functools
import logging
import sys

import torch

log = logging.getLogger("overdrive")


def _traceable_linear_input_act(original, activations: dict):
    @functools.wraps(original)
    def linear_input_act(linear, x, input_act):
        if torch.compiler.is_compiling():
            return linear(activations[input_act](x))
        return original(linear, x, input_act)

    linear_input_act.overdrive_replaces = original
    return linear_input_act


def install() -> None:
    """Idempotent; a ComfyUI without the function (older than 0.33) is left as it is."""
    ops = sys.modules.get("comfy.ops")
    current = getattr(ops, "linear_input_act", None)
    activations = getattr(ops, "INPUT_ACT_EAGER", None)
    if current is None or activations is None or hasattr(current, "overdrive_replaces"):
        return
    ops.linear_input_act = _traceable_linear_input_act(current, activations)
    log.debug("Overdrive: comfy.ops.linear_input_act runs its layer on the activation's output while torch.compile "
              "traces (comfy-kitchen's fused INT8 quantizer cannot be traced)")

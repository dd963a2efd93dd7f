"""The quantized layers of one model at one setting, made once per process and shared by every Quantize Model run that
asks for them again.

A LoRA strength, a LoRA file, the prompt or the seed changes Quantize Model's inputs, so ComfyUI runs the node again;
the model underneath is the same. Keyed by the weights without their LoRAs (quantized_model.base_tensors) and the
settings, the second run takes the layers of the first: no load of the float model, no calibration, no quantizing,
and no second copy of the 8-bit weights in memory. The registry holds the sets weakly: a set lives as long as a model
ComfyUI keeps (its output cache, a loaded model) runs it, and as long as the float model it was made from, where it is
the last set made or taken for that model (ComfyUI drops the clones that ran it when a LoRA or strength changes, before
Quantize Model runs again); it goes with the last of them.
"""
import dataclasses
import hashlib
import json
import weakref

from ..quantization.report import QuantReport
from .quantized_lora import SidePaths
from .quantized_streaming import StreamedBlocks

_LIVE: "weakref.WeakValueDictionary[str, QuantizedSet]" = weakref.WeakValueDictionary()
# the diffusion model (ComfyUI's loader's, shared by its clones) -> the set made or taken last for it
_LATEST: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)
class QuantizedSet:
    """`layers`: {name: quantized layer}, shared by every clone that runs them (never written after they are made);
    `report`: the decisions, saved under the calibration's `context` (another process quantizing its copy the same way
    reads them there: Parallel Model's workers); `side_paths`: their LoRA side paths; `streaming`: the pinned host
    copies of those a short card streams (one per layer, whichever clone runs it); `live_followers`: the device
    followers of the clones that run them (quantized_follower.py)."""

    layers: dict
    report: QuantReport
    side_paths: SidePaths
    key: str = ""
    context: str | None = None
    streaming: StreamedBlocks = dataclasses.field(default_factory=StreamedBlocks)
    live_followers: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)  # clones' QuantizedModules


def set_key(fingerprint: str, config: dict, fmt: str, device, float_layers) -> str:
    """The registry's key: the weights' fingerprint, the settings, the format, the device and the layers a family keeps
    in 16 bits. Not the calibration's resolution or prompt: layers measured at one size serve the others (a user
    changing the size between prompts waits for no calibration; a new process calibrates at its own)."""
    text = json.dumps([fingerprint, config, fmt, str(device), sorted(map(str, float_layers))], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def live(key: str) -> QuantizedSet | None:
    return _LIVE.get(key)


def keep(quantized: QuantizedSet, made_from) -> QuantizedSet:
    """`quantized`, findable by its key while it lives, and kept as long as `made_from` (the diffusion model its
    layers were quantized from) lives, until another set is kept for that model."""
    _LIVE[quantized.key] = quantized
    _LATEST[made_from] = quantized
    return quantized


def live_sets() -> list:
    """The quantized sets alive in this process (for the log and the soak's memory figures)."""
    return list(_LIVE.values())

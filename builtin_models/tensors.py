"""A checkpoint is first described, not built: a list of (key, shape, init) entries. The layer helpers
below spell the LDM parameter names once, so unet.py, clip.py and vae.py only say how layers nest."""
from typing import List, NamedTuple, Tuple, Union

# How an entry is filled (see weights.py): "normal" N(0, 1/fan_in), "small" that times SMALL_GAIN (DiT modulation
# layers), "bias" small noise around 0, "ones" small noise around 1 (norm scales), a float a constant.
Init = Union[str, float]


class TensorSpec(NamedTuple):
    key: str
    shape: Tuple[int, ...]
    init: Init = "normal"


Specs = List[TensorSpec]


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def linear(prefix: str, out_features: int, in_features: int, bias: bool = True) -> Specs:
    out = [TensorSpec(_key(prefix, "weight"), (out_features, in_features))]
    return out + [TensorSpec(_key(prefix, "bias"), (out_features,), "bias")] if bias else out


def conv(prefix: str, out_channels: int, in_channels: int, kernel: int) -> Specs:
    return [TensorSpec(_key(prefix, "weight"), (out_channels, in_channels, kernel, kernel)),
            TensorSpec(_key(prefix, "bias"), (out_channels,), "bias")]


def norm(prefix: str, channels: int) -> Specs:
    """GroupNorm or LayerNorm: an affine scale and shift, near the identity."""
    return [TensorSpec(_key(prefix, "weight"), (channels,), "ones"),
            TensorSpec(_key(prefix, "bias"), (channels,), "bias")]


def with_prefix(prefix: str, specs: Specs) -> Specs:
    return [s._replace(key=prefix + s.key) for s in specs]

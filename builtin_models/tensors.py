"""A checkpoint is first described, not built: a list of (key, shape, init) entries. The layer helpers
below spell the LDM parameter names once, so unet.py, clip.py and vae.py only say how layers nest."""
from typing import List, NamedTuple, Tuple, Union

# How an entry is filled (see weights.py): "normal" draws N(0, 1/fan_in) from the seed, "bias" small
# N(0, 0.01) noise, "ones"/"zeros" are constants (norm scales and shifts), and a float is a 0-d constant.
Init = Union[str, float]


class TensorSpec(NamedTuple):
    key: str
    shape: Tuple[int, ...]
    init: Init = "normal"


Specs = List[TensorSpec]


def linear(prefix: str, out_features: int, in_features: int, bias: bool = True) -> Specs:
    out = [TensorSpec(f"{prefix}.weight", (out_features, in_features))]
    return out + [TensorSpec(f"{prefix}.bias", (out_features,), "bias")] if bias else out


def conv(prefix: str, out_channels: int, in_channels: int, kernel: int) -> Specs:
    return [TensorSpec(f"{prefix}.weight", (out_channels, in_channels, kernel, kernel)),
            TensorSpec(f"{prefix}.bias", (out_channels,), "bias")]


def norm(prefix: str, channels: int) -> Specs:
    """GroupNorm or LayerNorm: both hold an affine scale and shift, which start at the identity."""
    return [TensorSpec(f"{prefix}.weight", (channels,), "ones"),
            TensorSpec(f"{prefix}.bias", (channels,), "zeros")]


def with_prefix(prefix: str, specs: Specs) -> Specs:
    return [s._replace(key=prefix + s.key) for s in specs]

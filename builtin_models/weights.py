"""Fixed-seed values for a TensorSpec. Each tensor draws from its own generator, seeded from (seed, key):
its values do not depend on which other tensors exist or in what order they are written, so tensors can
be made one at a time, streamed to disk, and a spec change elsewhere leaves this one unchanged."""
import hashlib

import torch

from .tensors import TensorSpec

# Every tensor depends on the seed (norm scales and biases too): switching between two seeds' checkpoints
# then changes every weight, so a weight that failed to switch shows up.
NOISE_STD = 0.02
SMALL_GAIN = 0.1


def tensor_seed(seed: int, key: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def make_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Drawn in float32, then cast: one seed gives the same model (up to rounding) at any storage dtype."""
    if isinstance(spec.init, float):
        return torch.full(spec.shape, spec.init, dtype=dtype)
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.key))
    x = torch.randn(spec.shape, generator=generator)
    if spec.init in ("normal", "small"):  # fan-in scaling keeps activations near unit variance at any width and depth
        fan_in = x[0].numel() if x.ndim > 1 else 1
        x.mul_(fan_in ** -0.5 * (SMALL_GAIN if spec.init == "small" else 1.0))
    elif spec.init in ("bias", "ones"):
        x.mul_(NOISE_STD).add_(1.0 if spec.init == "ones" else 0.0)
    else:
        raise ValueError(f"unknown init {spec.init!r} for {spec.key}")
    return x.to(dtype)

"""The two measures behind every decision.

**Layer error: normalised MSE (NMSE).** On the layer's real calibration inputs X (a subsample of rows),

    error = mean((y_q - y)^2) / mean(y^2)

where y = X W^T + b is the float32 reference output (computed from the layer's own float weights) and y_q is the
output of the quantized module, through the same low-precision kernel it will run with. It is the inverse of the
signal-to-quantization-noise ratio: error 0.01 = SQNR 20 dB (noise power 1 % of the output power, ~10 % relative
RMS error); int8 W8A8 typically measures ~1e-4 on well-behaved layers, fp8 e4m3 ~1e-3. The denominator is the
output power, not its variance, so a layer with a large constant offset is not judged harsher than its noise.
A layer whose reference output is all zeros has error 0 if y_q is zero too and infinity otherwise.

**Compute density** (arithmetic intensity) = FLOPs / bytes moved for one call of the layer, counting fp16
(2-byte) input, weight and output, each read or written once:
- linear, input (M, K), weight (N, K):  2*M*N*K / (2*(M*K + N*K + M*N))
- conv2d, input (B, C, H, W), weight (O, C/g, kh, kw), output (B, O, Ho, Wo), g groups, as an implicit GEMM
  with M = B*Ho*Wo rows, K = C/g*kh*kw, N = O:  2*M*N*K / (2*(B*C*H*W + O*C/g*kh*kw + B*O*Ho*Wo))
M is the largest row count seen in calibration. A layer runs an 8-bit GEMM only if error < its threshold AND
density >= compute_density_threshold: below the GPU's ridge point (~300 FLOP/byte on an H100 for fp16) a layer
is memory-bound, and is stored weight-only instead, unless its 8-bit GEMM measures faster than that
(calibrate._gemm_if_faster).
"""
from __future__ import annotations

import math

import torch

FP16_BYTES = 2


def normalised_mse(y_q: torch.Tensor, y_ref: torch.Tensor) -> float:
    """mean((y_q - y_ref)^2) / mean(y_ref^2), in float64 on the tensors' device (one host sync)."""
    y_ref = y_ref.double()
    noise = (y_q.double() - y_ref).pow(2).mean()
    power = y_ref.pow(2).mean()
    noise, power = torch.stack([noise, power]).tolist()
    if power == 0.0:
        return 0.0 if noise == 0.0 else math.inf
    return noise / power


def sqnr_db(error: float | None) -> float | None:
    """The error as a signal-to-quantization-noise ratio in dB (None stays None)."""
    if error is None:
        return None
    if error <= 0:
        return math.inf
    if math.isinf(error):
        return -math.inf
    return -10.0 * math.log10(error)


def linear_density(m: int, k: int, n: int) -> float:
    flops = 2.0 * m * n * k
    moved = FP16_BYTES * (m * k + n * k + m * n)
    return flops / moved if moved else 0.0


def conv2d_density(input_shape, weight_shape, output_shape, groups: int = 1) -> float:
    b, c, h, w = input_shape
    o, c_per_group, kh, kw = weight_shape
    _, _, ho, wo = output_shape
    m, k, n = b * ho * wo, c_per_group * kh * kw, o
    flops = 2.0 * m * n * k
    moved = FP16_BYTES * (b * c * h * w + o * c_per_group * kh * kw + b * o * ho * wo)
    return flops / moved if moved else 0.0


def conv2d_output_hw(module, h: int, w: int) -> tuple:
    """Output height/width of an nn.Conv2d for an input of h x w (padding as numbers or 'same'/'valid')."""
    out = []
    for i, size in enumerate((h, w)):
        k, s, d = module.kernel_size[i], module.stride[i], module.dilation[i]
        if isinstance(module.padding, str):
            if module.padding == "same":
                out.append(size)
                continue
            p = 0
        else:
            p = module.padding[i]
        out.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
    return tuple(out)

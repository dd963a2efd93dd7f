"""How alike two images are: PSNR and SSIM (Wang et al. 2004: an 11x11 Gaussian window of sigma 1.5, K1 0.01, K2 0.03,
per channel, then averaged), for the fidelity benchmark, its CPU tests and the main job. Images are float tensors in
[0, 1] of shape (..., height, width, channels) as ComfyUI's IMAGE is; a video compares frame by frame."""
import math

import torch
import torch.nn.functional as F


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """In dB; inf where the images are equal."""
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-x ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean structural similarity over every window, channel and frame: 1 where the images are equal."""
    def planes(t):  # (..., H, W, C) -> (N, 1, H, W)
        t = t.double().reshape(-1, *t.shape[-3:]).movedim(-1, 1)
        return t.reshape(-1, 1, *t.shape[-2:])
    x, y, window = planes(a), planes(b), _gaussian_window()
    mean = lambda t: F.conv2d(t, window)  # noqa: E731 ("valid" windows, as the reference implementation)
    mx, my = mean(x), mean(y)
    vx, vy, cov = mean(x * x) - mx ** 2, mean(y * y) - my ** 2, mean(x * y) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    score = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return float(score.mean())


def load_image(path) -> torch.Tensor:
    """An 8-bit image file as (height, width, 3) in [0, 1]."""
    import numpy as np
    from PIL import Image
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0)

"""The number formats' constants, shared by the reference kernels (kernels.py) and the Triton ones
(triton_kernels.py)."""
import torch

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Static activation scales map HEADROOM x the calibration amax to 448, so inputs of later sampling steps may grow
# that much before they saturate; e4m3 is floating point, so the headroom costs no relative precision (only values
# below ~1e-4 of the amax become subnormal).
STATIC_HEADROOM = 2.0
INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA wants M > 16
EPS = 1e-12
INT4_MAX = 7            # symmetric levels -7..7 from the scale; -8, the format's spare code, takes rounding only
INT4_GROUP = 128        # input channels per int4 scale
INT4_TO_FP8 = 32.0      # |q x ratio| <= 8 maps to <= 256, inside e4m3's 448 and above its subnormals down to ratio 2^-8
INT4_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # each group keeps the clipping of its amax with the least squared error

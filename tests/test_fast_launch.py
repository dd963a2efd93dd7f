"""fast_launch.FastLaunch: its key separates every case Triton compiles apart (CPU), and launches through the kept
compiled kernel give Triton's own results (GPU, skipped without one)."""
import pytest
import torch

from overdrive.fast_launch import FastLaunch, _arg_key


def test_key_separates_what_triton_specializes_on():
    x = torch.zeros(64)
    assert _arg_key(x) != _arg_key(x[1:])                      # 16-byte alignment of the pointer
    assert _arg_key(x) != _arg_key(x.half())                   # dtype
    assert len({_arg_key(n) for n in (1, 16, 17, 2**40)}) == 4  # one, a multiple of 16, other, 64-bit
    assert _arg_key(17) == _arg_key(19) and _arg_key(0.5) == _arg_key(2.0)
    assert _arg_key((16, 17)) == (_arg_key(16), _arg_key(17))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kept_kernel_launches_give_tritons_results():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    launch = FastLaunch(add_one)
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    for source, n in ((x, 1000), (x, 1000), (x[1:], 999), (x[1:], 999), (x, 992)):
        out = torch.zeros_like(source)
        launch[(triton.cdiv(n, 128),)](source, out, n, BLOCK=128, num_warps=4)
        torch.testing.assert_close(out, source + 1)
    assert launch.enabled and len(launch.compiled) == 3  # aligned and n % 16 != 0, misaligned, n % 16 == 0

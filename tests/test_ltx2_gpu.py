"""LTX-2 on a GPU, through the tests tests/test_ltx2.py runs on the CPU: the same tiny LTXAV model in bf16 on CUDA,
where Compile Model also replays its blocks as CUDA graphs, whose inputs and outputs are the (video, audio) tuple's
tensors. Skipped without CUDA (CI has no GPU); run on the GPU machine with
`python3 -m pytest tests/test_ltx2_gpu.py`."""
import pytest
import torch

# The CPU module's fixtures and tests, here on the GPU through this module's `comfy`, `device` and `per_call_tolerance`.
from test_ltx2 import (base, compiled, eager, latent, nodes, sample,  # noqa: F401
                       test_compile_model_compiles_the_block_once_and_matches_eager_per_call,
                       test_quantize_model_calibrates_on_the_audio_video_latent,
                       test_step_cache_reuses_both_streams_and_is_exact_on_full_steps)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def comfy():
    from overdrive.runner.inprocess import import_comfy
    return import_comfy(cpu=False)


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda"), torch.bfloat16


@pytest.fixture(scope="module")
def per_call_tolerance():
    return 2e-2  # compiled vs eager in bf16

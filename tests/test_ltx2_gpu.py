"""LTX-2 on a GPU, through the tests tests/test_dit_families.py and tests/test_ltx2.py run on the CPU: the built-in
tiny file in bf16 on CUDA, where Compile Model also replays its blocks as CUDA graphs, whose inputs and outputs are the
(video, audio) tuple's tensors. Skipped without CUDA (CI has no GPU); run on the GPU machine with
`python3 -m pytest tests/test_ltx2_gpu.py`."""
import pytest
import torch

# The CPU modules' fixtures and tests, here on the GPU through this module's `comfy`, `family` and `per_call_tolerance`.
from test_dit_families import (base, compiled, composition, eager, first_file, models_folder, nodes,  # noqa: F401
                               sample, second_file,
                               test_compile_model_compiles_each_distinct_block_once_and_matches_eager_per_call,
                               test_step_cache_on_the_compiled_model_compiles_no_more_and_matches_it_eager,
                               test_switch_diffusion_model_swaps_in_another_file_of_the_family_without_recompiling)
from test_ltx2 import test_quantize_model_calibrates_on_the_audio_video_latent  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def comfy():
    from overdrive.harness.inprocess import import_comfy
    return import_comfy(cpu=False)


@pytest.fixture(scope="module")
def family():
    return "ltx2"


@pytest.fixture(scope="module")
def per_call_tolerance():
    return 2e-2  # compiled vs eager in bf16

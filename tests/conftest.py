import os

import pytest
import torch

from comfy_env import import_comfy_in_process

# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(int(os.environ.get("OVERDRIVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's real modules, imported in this process (CPU)."""
    return import_comfy_in_process()

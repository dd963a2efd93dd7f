import os
import tempfile

import pytest
import torch

from comfy_env import import_comfy_in_process

# Two cores on CI: keep torch from oversubscribing them.
# Compiled artifacts of test runs stay out of the user's cache.
os.environ.setdefault("OVERDRIVE_CACHE_DIR", tempfile.mkdtemp(prefix="overdrive-test-cache-"))
torch.set_num_threads(int(os.environ.get("OVERDRIVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def comfy():
    """ComfyUI's real modules, imported in this process (CPU)."""
    return import_comfy_in_process()

"""The real ComfyUI under test, imported in-process (its own modules; no mocks)."""
from overdrive.harness.inprocess import import_comfy
from overdrive.harness.server import find_comfyui as comfyui_path  # noqa: F401


def import_comfy_in_process():
    """Import ComfyUI's own modules into this process, configured like `main.py --cpu --use-pytorch-cross-attention`."""
    return import_comfy(cpu=True)

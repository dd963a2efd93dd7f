"""Overdrive: fast diffusion inference for ComfyUI on NVIDIA GPUs.

This folder is both a ComfyUI custom-node pack (ComfyUI calls `comfy_entrypoint` below for its V3 nodes) and the
Python package `overdrive`, whose core (compiler/, quantization/, step_cache/) works on plain torch modules without
ComfyUI.
"""
import importlib.util

# The nodes import ComfyUI; outside ComfyUI the package still imports, without them.
if importlib.util.find_spec("comfy") is not None:
    async def comfy_entrypoint():
        from .nodes import OverdriveExtension
        return OverdriveExtension()

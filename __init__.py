"""Overdrive: fast diffusion inference for ComfyUI on NVIDIA GPUs.

This folder is both a ComfyUI custom-node pack (ComfyUI reads NODE_CLASS_MAPPINGS below) and the
Python package `overdrive`, whose core (compiler/, quantization/, deepcache/) works on plain torch
modules without ComfyUI.
"""
import importlib.util

NODE_CLASS_MAPPINGS = {}
NODE_DISPLAY_NAME_MAPPINGS = {}

# The nodes import ComfyUI; outside ComfyUI the package still imports, without them.
if importlib.util.find_spec("comfy") is not None:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F811

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

"""Run a real ComfyUI headless with Overdrive and drive it over its HTTP API (main job, tests, benchmarks)."""
from .client import ComfyClient
from .server import ComfyServer, find_comfyui

__all__ = ["ComfyClient", "ComfyServer", "find_comfyui"]

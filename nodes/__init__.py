"""ComfyUI node registrations. Each node is a thin adapter over the core packages."""
from .compile_nodes import OverdriveCompileModel, OverdriveCompileVAE

NODE_CLASS_MAPPINGS = {
    "OverdriveCompileModel": OverdriveCompileModel,
    "OverdriveCompileVAE": OverdriveCompileVAE,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "OverdriveCompileModel": "Compile Model (Overdrive)",
    "OverdriveCompileVAE": "Compile VAE (Overdrive)",
}

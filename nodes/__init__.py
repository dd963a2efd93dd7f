"""ComfyUI node registrations. Each node is a thin adapter over the core packages."""
from .builtin_conditioning import OverdriveBuiltinConditioning
from .compile_nodes import OverdriveCompileModel, OverdriveCompileVAE
from .deepcache_node import OverdriveDeepCache
from .quantize_node import OverdriveQuantizeModel
from .switch_weights_node import OverdriveSwitchDiffusionModel, OverdriveSwitchWeights

NODE_CLASS_MAPPINGS = {
    "OverdriveCompileModel": OverdriveCompileModel,
    "OverdriveCompileVAE": OverdriveCompileVAE,
    "OverdriveSwitchWeights": OverdriveSwitchWeights,
    "OverdriveSwitchDiffusionModel": OverdriveSwitchDiffusionModel,
    "OverdriveDeepCache": OverdriveDeepCache,
    "OverdriveQuantizeModel": OverdriveQuantizeModel,
    "OverdriveBuiltinConditioning": OverdriveBuiltinConditioning,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "OverdriveCompileModel": "Compile Model (Overdrive)",
    "OverdriveCompileVAE": "Compile VAE (Overdrive)",
    "OverdriveSwitchWeights": "Switch Weights (Overdrive)",
    "OverdriveSwitchDiffusionModel": "Switch Diffusion Model (Overdrive)",
    "OverdriveDeepCache": "DeepCache (Overdrive)",
    "OverdriveQuantizeModel": "Quantize Model (Overdrive)",
    "OverdriveBuiltinConditioning": "Built-in Conditioning (Overdrive)",
}


"""The ComfyUI nodes (V3 schema), each a thin adapter over the core packages, and the extension that lists them."""
from comfy_api.latest import ComfyExtension, io

from .builtin_conditioning import OverdriveBuiltinConditioning
from .compile_nodes import OverdriveCompileModel, OverdriveCompileVAE
from .deepcache_node import OverdriveDeepCache
from .parallel_model import OverdriveParallelModel
from .quantize_node import OverdriveQuantizeModel
from .sparse_video_node import OverdriveSparseVideoAttention
from .switch_weights_node import OverdriveSwitchDiffusionModel, OverdriveSwitchWeights

NODE_LIST = [OverdriveCompileModel, OverdriveCompileVAE, OverdriveSwitchWeights, OverdriveSwitchDiffusionModel,
             OverdriveDeepCache, OverdriveQuantizeModel, OverdriveBuiltinConditioning, OverdriveParallelModel,
             OverdriveSparseVideoAttention]
# node id -> class, as ComfyUI registers them: each class is named after its node id (test_server checks the ids), so
# importing the nodes builds no schema (the switch nodes' schemas list the model folders).
NODES = {node.__name__: node for node in NODE_LIST}


class OverdriveExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODE_LIST

"""A Parallel Model worker's copy of a ComfyUI model (comfy_host/parallel_calls.py). Apart from the nodes, and importing
nothing of ComfyUI until it runs: a worker unpickles this before it has its GPU, and ComfyUI picks its device when
comfy.model_management is first imported."""
import sys


def comfy_in_worker(cpu: bool):
    """ComfyUI's modules in a worker process (spawned with the first process's sys.path, ComfyUI's folder on it), set
    up as there but with ComfyUI's classic model loading: a worker holds its own copy of the model."""
    import comfy.cli_args
    args = comfy.cli_args.args
    args.cpu = cpu
    args.use_pytorch_cross_attention = cpu or args.use_pytorch_cross_attention
    args.disable_dynamic_vram = True
    import comfy.model_management, comfy.model_patcher, comfy.sd  # noqa: E401,F401
    return sys.modules["comfy"]


class ComfyReload:
    """The model reloaded as ComfyUI loaded it (its ModelPatcher's `cached_patcher_init`), on the worker's device,
    with the weight patches (LoRA) of the ModelPatcher that runs it in ComfyUI's process ({key: [(strength_patch,
    patch, strength_model, offset, function)]}, ModelPatcher.patches), quantized and compiled as that one is; called
    as ComfyUI's BaseModel.apply_model."""

    def __init__(self, init: tuple, patches: dict | None = None, stack=None, quantize: tuple | None = None):
        load, self.arguments, *self.index = init
        self.loader = (load.__module__, load.__qualname__)  # by name: unpickling the function would import ComfyUI
        self.patches = patches or {}
        self.stack = stack  # Overdrive's forward (stack.Stack); its attention override travels with each call
        self.quantize = quantize  # Quantize Model's recipe (quantized_model.RECIPE), its decisions cached

    def __call__(self, device):
        model = self.load(device).model
        return lambda x, timestep, **kwargs: model.apply_model(x, timestep, **kwargs)

    def load(self, device):
        """The ModelPatcher, loaded on `device` with the patches and forward it was given."""
        import importlib

        comfy = comfy_in_worker(cpu=device.type == "cpu")
        load = getattr(importlib.import_module(self.loader[0]), self.loader[1])
        patcher = load(*self.arguments, disable_dynamic=True)
        index = self.index
        if index:
            patcher = patcher[index[0]]
        for key, entries in self.patches.items():
            for strength_patch, patch, strength_model, offset, function in entries:
                full_key = key if offset is None and function is None else (key, offset, function)
                patcher.add_patches({full_key: patch}, strength_patch, strength_model)
        if self.quantize is not None:  # the same layers and formats as the first process's copy, LoRA baked in
            from .quantized_model import requantized
            patcher = requantized(patcher, self.quantize)
        if self.stack is not None:  # as Compile Model put it on the first process's copy
            from .forward_patch import install
            install(patcher, self.stack)
        comfy.model_management.load_models_gpu([patcher])
        return patcher

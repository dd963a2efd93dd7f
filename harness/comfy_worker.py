"""A Parallel Model worker's copy of a ComfyUI model (nodes/parallel_model.py). Apart from the nodes, and importing
nothing of ComfyUI until it runs: a worker unpickles this before it has its GPU, and ComfyUI picks its device when
comfy.model_management is first imported."""


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
        self.quantize = quantize  # Quantize Model's recipe (nodes/quantize_node.py RECIPE), its decisions cached

    def __call__(self, device):
        model = self.load(device).model
        return lambda x, timestep, **kwargs: model.apply_model(x, timestep, **kwargs)

    def load(self, device):
        """The ModelPatcher, loaded on `device` with the patches and forward it was given."""
        import importlib

        from .inprocess import import_comfy
        comfy = import_comfy(cpu=device.type == "cpu")
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
            from ..nodes.quantize_node import requantized
            patcher = requantized(patcher, self.quantize)
        if self.stack is not None:  # as Compile Model put it on the first process's copy
            from ..nodes.forward_patch import install
            install(patcher, self.stack)
        comfy.model_management.load_models_gpu([patcher])
        return patcher

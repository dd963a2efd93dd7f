"""A Parallel Model worker's copy of a ComfyUI model (nodes/parallel_model.py). Apart from the nodes, and importing
nothing of ComfyUI until it runs: a worker unpickles this before it has its GPU, and ComfyUI picks its device when
comfy.model_management is first imported."""


class ComfyReload:
    """The model reloaded as ComfyUI loaded it (its ModelPatcher's `cached_patcher_init`), on the worker's device,
    with the weight patches (LoRA) of the ModelPatcher that runs it in ComfyUI's process ({key: [(strength_patch,
    patch, strength_model, offset, function)]}, ModelPatcher.patches); called as ComfyUI's BaseModel.apply_model."""

    def __init__(self, init: tuple, patches: dict | None = None):
        load, self.arguments, *self.index = init
        self.loader = (load.__module__, load.__qualname__)  # by name: unpickling the function would import ComfyUI
        self.patches = patches or {}

    def __call__(self, device):
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
        comfy.model_management.load_models_gpu([patcher])
        model = patcher.model
        return lambda x, timestep, **kwargs: model.apply_model(x, timestep, **kwargs)

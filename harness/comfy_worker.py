"""A Parallel Model worker's copy of a ComfyUI model (nodes/parallel_model.py). Apart from the nodes, and importing
nothing of ComfyUI until it runs: a worker unpickles this before it has its GPU, and ComfyUI picks its device when
comfy.model_management is first imported."""


class ComfyReload:
    """The model reloaded as ComfyUI loaded it (its ModelPatcher's `cached_patcher_init`), on the worker's device;
    called as ComfyUI's BaseModel.apply_model."""

    def __init__(self, init: tuple):
        load, self.arguments, *self.index = init
        self.loader = (load.__module__, load.__qualname__)  # by name: unpickling the function would import ComfyUI

    def __call__(self, device):
        import importlib

        from .inprocess import import_comfy
        comfy = import_comfy(cpu=device.type == "cpu")
        load = getattr(importlib.import_module(self.loader[0]), self.loader[1])
        patcher = load(*self.arguments, disable_dynamic=True)
        index = self.index
        if index:
            patcher = patcher[index[0]]
        comfy.model_management.load_models_gpu([patcher])
        model = patcher.model
        return lambda x, timestep, **kwargs: model.apply_model(x, timestep, **kwargs)

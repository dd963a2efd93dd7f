"""What ComfyUI's loader records on each layer of a loaded model, and how to make layers look never loaded."""


def forget_load_state(modules) -> None:
    """Clear the marks ModelPatcher.load leaves on layers: `comfy_patched_weights` ("its weight patches are applied:
    skip it next load") and the low-VRAM casting state, as unloading does. For layers whose marks no longer hold:
    copies of a loaded model's layers, and float layers that were out of the module tree while ComfyUI unpatched it
    (it only clears the layers in the tree), which would otherwise come back marked and miss the next model's LoRA."""
    for module in modules:
        for layer in module.modules():
            state = layer.__dict__
            state.pop("comfy_patched_weights", None)
            if "prev_comfy_cast_weights" in state:  # a low-VRAM load switched weight casting on; undo as unloading does
                layer.comfy_cast_weights = state.pop("prev_comfy_cast_weights")
            for name in ("weight_function", "bias_function"):
                if name in state:
                    state[name] = []

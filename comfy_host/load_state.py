"""What ComfyUI's loader records on each layer of a loaded model, and how to make layers look never loaded."""

# What dynamic VRAM keeps about a model's loads: on its BaseModel (per model), and on each layer (handles to pinned host
# buffers and to the model's virtual GPU buffer, weight fetchers, and after a run the views of that buffer its last
# call read: comfy/ops.py's _v_weight, _v_bias, _prefetch). A copy of a model made for another checkpoint (Switch
# Weights) must not share or duplicate them: a duplicated host-buffer handle is freed twice, which aborts, and a view of
# the virtual buffer may be unmapped by then (copying it fails with "CUDA error: invalid argument").
MODEL_LOADER_STATE = ("dynamic_vbars", "dynamic_pins", "dynamic_patchers")
LAYER_LOADER_STATE = ("_v", "_v_block", "_v_signature", "_v_weight", "_v_bias", "_prefetch", "_pin_state", "_pins",
                      "weight_lowvram_function", "bias_lowvram_function")


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

"""Switch Weights and Switch Diffusion Model: another file's weights through the compiled model
(comfy_host/switched_weights.py)."""
import folder_paths
from comfy_api.latest import io

from ..comfy_host.switched_weights import switch_weights
from ..families import family_titles
from .schema import node_schema


class SwitchNode(io.ComfyNode):
    """The two switch nodes: one declaration, told apart by the folder their files come from."""
    NODE_ID = DISPLAY_NAME = DESCRIPTION_TEXT = FOLDER = INPUT = FILE_TOOLTIP = OUTPUT_TOOLTIP = ""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            cls.NODE_ID, cls.DISPLAY_NAME, cls.DESCRIPTION_TEXT,
            inputs=[io.Model.Input("model", tooltip="A model (ideally from Compile Model) whose architecture the file "
                                                    "shares. It is not modified."),
                    io.Combo.Input(cls.INPUT, options=folder_paths.get_filename_list(cls.FOLDER),
                                   tooltip=cls.FILE_TOOLTIP)],
            outputs=[io.Model.Output(tooltip=cls.OUTPUT_TOOLTIP)],
        )


class OverdriveSwitchWeights(SwitchNode):
    NODE_ID, DISPLAY_NAME, FOLDER, INPUT = "OverdriveSwitchWeights", "Switch Weights (Overdrive)", "checkpoints", \
        "ckpt_name"
    DESCRIPTION_TEXT = ("Runs another checkpoint's diffusion-model weights through a model compiled by Compile Model, "
                        "without compiling again. The checkpoint must be of the same architecture (e.g. two SDXL "
                        "fine-tunes); otherwise you get an error naming the mismatch and nothing changes.")
    FILE_TOOLTIP = ("Checkpoint whose diffusion-model weights to run. Its CLIP and VAE are not used: load them "
                    "separately if they differ.")
    OUTPUT_TOOLTIP = "The model with the new checkpoint's weights, on the same compiled graph."

    @classmethod
    def execute(cls, model, ckpt_name) -> io.NodeOutput:
        return io.NodeOutput(switch_weights(model, cls.FOLDER, ckpt_name))


class OverdriveSwitchDiffusionModel(SwitchNode):
    NODE_ID, DISPLAY_NAME, FOLDER, INPUT = "OverdriveSwitchDiffusionModel", "Switch Diffusion Model (Overdrive)", \
        "diffusion_models", "unet_name"
    DESCRIPTION_TEXT = ("Runs another diffusion-model file (the diffusion_models folder, as Load Diffusion Model "
                        f"reads: {family_titles()} and other models shipped without their text "
                        "encoders) through a model compiled by Compile Model, without compiling again. The file must "
                        "be of the same architecture; otherwise you get an error naming the mismatch and nothing "
                        "changes.")
    FILE_TOOLTIP = "Diffusion-model file whose weights to run (same architecture as the model)."
    OUTPUT_TOOLTIP = "The model with the new file's weights, on the same compiled graph."

    @classmethod
    def execute(cls, model, unet_name) -> io.NodeOutput:
        return io.NodeOutput(switch_weights(model, cls.FOLDER, unet_name))

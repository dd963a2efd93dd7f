"""Sparse Video Attention: a thin ComfyUI adapter over attention/video_sparsity.py (comfy_host/sparse_video.py)."""
from comfy_api.latest import io

from ..attention.video_sparsity import VideoSparsity
from ..comfy_host.sparse_video import video_family_names, with_sparse_video
from .schema import node_schema, patched_copy_input

DEFAULTS = VideoSparsity()

DESCRIPTION = (
    "Training-free sparse attention for video models ({families}): in the self-attention over a clip's frames, each "
    "frame attends only to the frames near it and to the first frames, so most of the attention work is skipped on "
    "long clips. The first sampling steps, which set the layout, stay dense. On NVIDIA GPUs it runs PyTorch's "
    "FlexAttention, a block-sparse kernel. It changes the image a little: check it against the same seed without "
    "this node. Works with Compile Model before or after it; not with Parallel Model (which then runs on one GPU). "
    "The log gives the mask's density and its error against dense attention at the first call of each size. Short "
    "clips, where the mask would keep most of the work, stay dense."
)


class OverdriveSparseVideoAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            "OverdriveSparseVideoAttention", "Sparse Video Attention (Overdrive)",
            DESCRIPTION.format(families=video_family_names()),
            inputs=[
                patched_copy_input(io.Model, "model", "video model", "accelerate"),
                io.Int.Input("window", default=DEFAULTS.window, min=0, max=64,
                             tooltip="How many frames on each side of its own a frame's tokens attend to (latent "
                                     "frames: the VAE packs several video frames in one). Larger is closer to dense "
                                     "attention and slower."),
                io.Int.Input("sink", default=DEFAULTS.sink, min=0, max=64,
                             tooltip="How many of the clip's first latent frames every frame also attends to: the "
                                     "first frame anchors the clip's look."),
                io.Float.Input("dense_steps", default=DEFAULTS.dense_steps, min=0.0, max=1.0, step=0.05,
                               tooltip="The share of each sampler run's steps, from the first, that run dense "
                                       "attention (they set the layout; a second sampler of a split schedule counts "
                                       "its own steps). 1 = always dense: the same image as without this node."),
            ],
            outputs=[io.Model.Output(tooltip="The same model, its video self-attention sparse.")],
        )

    @classmethod
    def execute(cls, model, window=DEFAULTS.window, sink=DEFAULTS.sink,
                dense_steps=DEFAULTS.dense_steps) -> io.NodeOutput:
        return io.NodeOutput(with_sparse_video(model, VideoSparsity(int(window), int(sink), float(dense_steps))))

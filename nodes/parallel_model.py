"""Parallel Model: one generation over several GPUs of this machine (comfy_host/parallel_calls.py)."""
import logging

import torch
from comfy_api.latest import io

from ..comfy_host.parallel_calls import GPUS, parallelize
from ..comfy_host.sequence_split import split_family_names
from ..parallel.config import MODES
from .schema import node_schema, patched_copy_input

log = logging.getLogger("overdrive")

DESCRIPTION = ("One generation over several GPUs of this machine: each step's conditional and unconditional passes "
               "on different GPUs (CFG parallelism), each GPU with its share of the image tokens (sequence "
               f"parallelism: {split_family_names()}), or both at once, each GPU holding its own copy of the "
               "model, loaded once for the prompts that follow. Without the GPUs asked for it runs on one, with a "
               "warning.")


class OverdriveParallelModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return node_schema(
            "OverdriveParallelModel", "Parallel Model (Overdrive)", description=DESCRIPTION,
            inputs=[patched_copy_input(io.Model, "model", "model", "split over the GPUs",
                                       "Loaded from a file: its workers load the same file, and its LoRA."),
                    io.Int.Input("gpus", default=GPUS, min=2, max=16,
                                 tooltip="How many GPUs of this machine share each generation (one process each)."),
                    io.Combo.Input("mode", options=list(MODES), default=MODES[0],
                                   tooltip="auto: the conditional and unconditional passes on different GPUs where "
                                           "there are as many passes as GPUs, else each pass on its own group of "
                                           "GPUs sharing its image tokens (4 GPUs, 2 passes), else every GPU with a "
                                           "share of the image tokens where the model allows it "
                                           f"({split_family_names()}). cfg: the passes only. sequence: the tokens only. both: "
                                           "passes and tokens at once.")],
            outputs=[io.Model.Output(tooltip="The model, its sampling steps split over the GPUs.")])

    @classmethod
    def execute(cls, model, gpus=GPUS, mode=MODES[0]) -> io.NodeOutput:
        if mode not in MODES:
            raise ValueError(f"Parallel Model: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        available = torch.cuda.device_count()
        if available < gpus:
            log.warning("Overdrive Parallel Model: %d GPU(s) asked for, %d here: the model runs on one GPU, as it is",
                        gpus, available)
            return io.NodeOutput(model.clone())
        try:
            return io.NodeOutput(parallelize(model, gpus, cuda=True, mode=mode))
        except ValueError as error:  # a model it cannot split yet: the generation goes on, on one GPU
            log.warning("Overdrive Parallel Model: the model runs on one GPU: %s", error)
            return io.NodeOutput(model.clone())

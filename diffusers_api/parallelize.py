"""parallelize_: a pipeline's (or a module's) calls split over the processes of a torch.distributed group."""
import torch.distributed as dist

from ..parallel.config import ParallelConfig
from ..core.stack import Stack
from .installed import install_each, installed_stack
from .targets import target_modules


def parallelize_(target, config: ParallelConfig | None = None) -> None:
    """Split each call of a pipeline's UNet or DiT transformer(s) (or of any module) over every process of the
    torch.distributed group this process belongs to: launch the script with `torchrun --nproc-per-node N`, call
    `torch.distributed.init_process_group()` (NCCL, each process on its own GPU), and run the same pipeline with the
    same seed in every process; each ends with the whole result.

    mode "cfg": a call's batch split (the pipelines that batch classifier-free guidance's two passes: SD3, SDXL,
    LTX-Video). mode "sequence": its image tokens, the attention over all of them, for Flux.1, Wan 2.1/2.2, SD3/3.5
    and Qwen-Image (Ulysses where the heads divide by the number of processes, else every process's keys gathered;
    the tokens must divide). "both": each batch entry on its own group of processes, which splits its tokens.
    "auto": cfg, both, sequence, the first that applies. A call that cannot be split runs whole in every process;
    the log says why, once.
    Composes with compile_ (the all-to-alls are traced into the compiled blocks), deepcache_ (every process reuses
    the same steps: the adaptive measure is summed over all of them), attention_ and quantize_ (process 0 decides
    for all, so every process runs the same 8-bit layers), in any order.
    """
    config = ParallelConfig() if config is None else config
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"parallelize_: config must be a ParallelConfig, not {type(config).__name__}; e.g. "
                        "ParallelConfig(mode='auto'). Nothing was changed.")
    if not dist.is_initialized():
        raise RuntimeError("parallelize_ runs in every process of a torch.distributed group: launch the script with "
                           "`torchrun --nproc-per-node N` and call torch.distributed.init_process_group() before it. "
                           "Nothing was changed.")
    install_each([(module, (installed_stack(module) or Stack()).with_parallel(config))
                  for _, module in target_modules(target, "parallelize_")])

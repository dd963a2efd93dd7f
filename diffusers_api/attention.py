"""attention_: a pipeline's (or a module's) SDPA calls through Overdrive's attention kernels, chosen per shape."""
from ..attention.choice import AttentionConfig
from ..core.stack import Stack
from .installed import install_each, installed_stack
from .targets import target_modules


def attention_(target, config: AttentionConfig | None = None) -> None:
    """Route the attention of a pipeline's UNet or DiT transformer(s) (or of any module) through Overdrive's attention.

    Every SDPA call the model makes without a mask, dropout or causal flag goes to `torch.ops.overdrive.attention`:
    at each new shape the first call measures the backends against SDPA on its own inputs: the 16-bit kernels (SDPA's
    cuDNN kernel, FlashAttention-3 where fa3-fwd is installed) and, on Hopper and newer, the 8-bit ones (Triton
    int8/fp8, cuDNN fp8 where nvidia-cudnn-frontend is installed); mode "auto" keeps the fastest within
    `config.max_error` that is at least 3 % faster than SDPA, "exact" the same among the 16-bit kernels, "8bit" the
    fastest 8-bit one even if slower; the choice and its figures are logged. Other calls run SDPA.
    `AttentionConfig(mode="sdpa")` turns it off.
    Composes with compile_ (the custom op is traced into the compiled code), quantize_ and deepcache_, in any order.
    """
    config = AttentionConfig() if config is None else config
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"attention_: config must be an AttentionConfig, not {type(config).__name__}; e.g. "
                        "AttentionConfig(mode='auto', max_error=0.05). Nothing was changed.")
    routed = None if config.mode == "sdpa" else config
    install_each([(module, (installed_stack(module) or Stack()).with_attention(routed))
                  for _, module in target_modules(target, "attention_")])

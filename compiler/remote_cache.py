"""A fleet of ComfyUI workers compiling each architecture once: Inductor's remote caches (FX graphs, autotuning)
in Redis. A shared folder works too: point OVERDRIVE_CACHE_DIR of every worker at it (writes are atomic)."""
import logging
import os

import torch

log = logging.getLogger("overdrive.compiler")


def use_redis_cache(url: str) -> None:
    """Read and write compiled artifacts in the Redis at `url` (redis://host:port/db), besides the local caches."""
    try:
        import redis  # noqa: F401  (Inductor's remote cache client)
    except ImportError as error:
        raise RuntimeError("OVERDRIVE_REDIS_URL is set but the `redis` package is missing: pip install redis") from error
    os.environ["TORCHINDUCTOR_REDIS_URL"] = url
    torch._inductor.config.fx_graph_remote_cache = True
    torch._inductor.config.autotune_remote_cache = True
    log.info("Overdrive: sharing compiled artifacts through Redis at %s", url)


_configured = []


def configure_from_environment() -> None:
    """OVERDRIVE_REDIS_URL, applied once per process, before the first compile."""
    if _configured:
        return
    _configured.append(True)
    url = os.environ.get("OVERDRIVE_REDIS_URL")
    if url:
        use_redis_cache(url)

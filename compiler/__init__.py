"""Overdrive's compiler core: torch.compile with graphs shared per architecture and an eager fallback."""
from .compiled_method import CompiledMethod, compile_module, uncompile_module
from .disk_cache import CompileDiskCache
from .fingerprint import architecture_fingerprint
from .options import CompileOptions
from .remote_cache import configure_from_environment, use_redis_cache
from .switch_weights import WeightMismatchError, copy_weights_, twin_with_weights
from .shared_graph import clear_shared_graphs, dynamo_graph_count, get_disk_cache, set_disk_cache

__all__ = [
    "CompileOptions", "CompiledMethod", "compile_module", "uncompile_module", "architecture_fingerprint",
    "clear_shared_graphs", "dynamo_graph_count", "CompileDiskCache", "set_disk_cache", "get_disk_cache",
    "use_redis_cache", "WeightMismatchError", "twin_with_weights", "copy_weights_",
]

configure_from_environment()  # OVERDRIVE_REDIS_URL: share compiled artifacts across workers

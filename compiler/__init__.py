"""Overdrive's compiler core: torch.compile with graphs shared per architecture and an eager fallback."""
from .compiled_method import CompiledMethod, compile_module, uncompile_module
from .disk_cache import CompileDiskCache, disk_cache_for
from .fingerprint import architecture_fingerprint
from .options import CompileOptions
from .remote_cache import use_redis_cache
from .switch_weights import WeightMismatchError, copy_weights_, twin_with_weights
from .shared_graph import clear_shared_graphs, dynamo_graph_count

__all__ = [
    "CompileOptions", "CompiledMethod", "compile_module", "uncompile_module", "architecture_fingerprint",
    "clear_shared_graphs", "dynamo_graph_count", "CompileDiskCache", "disk_cache_for",
    "use_redis_cache", "WeightMismatchError", "twin_with_weights", "copy_weights_",
]

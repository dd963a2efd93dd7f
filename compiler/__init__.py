"""Overdrive's compiler core: torch.compile with graphs shared per architecture and an eager fallback."""
from .compiled_method import CompiledMethod, compile_module, uncompile_module
from .fingerprint import architecture_fingerprint
from .options import CompileOptions
from .shared_graph import clear_shared_graphs, dynamo_graph_count

__all__ = [
    "CompileOptions", "CompiledMethod", "compile_module", "uncompile_module", "architecture_fingerprint",
    "clear_shared_graphs", "dynamo_graph_count",
]

"""The shape every Overdrive node schema shares: its id, name, category and description beside its inputs and
outputs (ComfyUI's V3 `io.Schema`)."""
from comfy_api.latest import io

CATEGORY = "overdrive"


def patched_copy_input(kind, name: str, what: str, verb: str, more: str = ""):
    """A node's first input, which it copies before patching: ComfyUI hands the same object to every node it feeds."""
    return kind.Input(name, tooltip=f"The {what} to {verb}. It is not modified; a patched copy is returned." +
                      (f" {more}" if more else ""))


def node_schema(node_id: str, display_name: str, description: str, *, inputs: list, outputs: list,
                category: str = CATEGORY) -> io.Schema:
    return io.Schema(node_id=node_id, display_name=display_name, category=category, description=description,
                     inputs=inputs, outputs=outputs)

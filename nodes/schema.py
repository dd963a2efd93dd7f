"""The shape every Overdrive node schema shares: its id, name, category and description beside its inputs and
outputs (ComfyUI's V3 `io.Schema`)."""
from comfy_api.latest import io

CATEGORY = "overdrive"


def node_schema(node_id: str, display_name: str, description: str, *, inputs: list, outputs: list,
                category: str = CATEGORY) -> io.Schema:
    return io.Schema(node_id=node_id, display_name=display_name, category=category, description=description,
                     inputs=inputs, outputs=outputs)

"""ComfyUI's two workflow formats, converted the way its own web frontend does, from the node definitions in
/object_info.

UI format (`X.json`): what the canvas saves and loads by drag-and-drop: nodes with positions, link slots, and
`widgets_values` (the node's widget values in widget order), plus a `links` table. API format (`X_api.json`): what
POST /prompt takes: {node id: {class_type, inputs}}. `ui_to_api` is the frontend's "Queue Prompt" conversion
(graphToPrompt); `api_to_ui` lays an API graph out on the canvas.
"""
import pathlib

CONTROL = None  # a widget the frontend saves in widgets_values but never sends (a seed's "control_after_generate")
WIDGET_KINDS = ("INT", "FLOAT", "STRING", "BOOLEAN")
COLUMN, GAP, WIDTH = 380, 40, 320  # canvas layout: column spacing, vertical gap, node width


def ui_twin(api_path) -> pathlib.Path:
    """workflows/X_api.json -> workflows/X.json."""
    path = pathlib.Path(api_path)
    return path.with_name(path.name.removesuffix("_api.json") + ".json")


def combo_options(spec: list):
    """The choices of a combo input (a V1 node's list of options, a V3 node's "COMBO" with `options`), else None."""
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    if isinstance(kind, list):
        return kind
    return options.get("options", []) if kind == "COMBO" else None


def node_slots(definition: dict) -> tuple[list, list]:
    """(widget names in widgets_values order, [(link input name, type)]), as the frontend builds a node."""
    widgets, links = [], []
    inputs = {**definition["input"].get("required", {}), **definition["input"].get("optional", {})}
    for name, spec in inputs.items():
        kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
        if options.get("forceInput") or options.get("defaultInput") or options.get("image_upload"):
            raise NotImplementedError(f"{definition['name']}.{name}: widgets shown as inputs or upload buttons")
        combo = combo_options(spec) is not None
        if combo or kind in WIDGET_KINDS:
            widgets.append(name)
            if options.get("control_after_generate") or (kind == "INT" and name in ("seed", "noise_seed")):
                if combo:
                    raise NotImplementedError(f"{definition['name']}.{name}: a list with control_after_generate")
                widgets.append(CONTROL)
        else:
            links.append((name, kind))
    return widgets, links


def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[1], int)


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """The API graph that "Queue Prompt" sends for this UI workflow (with each node's title as `_meta.title`)."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        if node.get("mode", 0) != 0:
            raise ValueError(f"node {node['id']} is muted or bypassed; un-mute it or take it out")
        definition = object_info[node["type"]]
        widgets, _ = node_slots(definition)
        values = node.get("widgets_values", [])
        if len(values) != len(widgets):
            raise ValueError(f"node {node['id']} ({node['type']}) has {len(values)} widget values, its widgets are "
                             f"{widgets}")
        inputs = {name: value for name, value in zip(widgets, values) if name is not CONTROL}
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                _, origin, origin_slot, *_ = links[slot["link"]]
                inputs[slot["name"]] = [str(origin), origin_slot]
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                "_meta": {"title": node.get("title", definition["display_name"])}}
    return api


def topological(api: dict) -> list:
    order, placed = [], set()
    def place(key):
        if key not in placed:
            placed.add(key)
            for value in api[key]["inputs"].values():
                if is_link(value):
                    place(value[0])
            order.append(key)
    for key in sorted(api, key=int):
        place(key)
    return order


def ui_node(key: str, node: dict, definition: dict, pos: list, order: int) -> dict:
    widgets, link_inputs = node_slots(definition)
    unknown = set(node["inputs"]) - set(widgets) - {name for name, _ in link_inputs}
    missing = [name for name in widgets if name is not CONTROL and name not in node["inputs"]]
    linked = [name for name in widgets if is_link(node["inputs"].get(name))]
    if unknown or missing or linked:
        raise ValueError(f"node {key} ({node['class_type']}): unknown inputs {sorted(unknown)}, widget values missing "
                         f"{missing}, widgets fed by links {linked}")
    values = ["fixed" if name is CONTROL else node["inputs"][name] for name in widgets]
    texts = sum(isinstance(value, str) and name is not CONTROL and len(value) > 40 for name, value in zip(widgets, values))
    slots = max(len(link_inputs), len(definition["output"]))
    out = {"id": int(key), "type": node["class_type"], "pos": pos, "size": [WIDTH, 46 + 24 * (len(values) + slots) + 70 * texts],
           "flags": {}, "order": order, "mode": 0,
           "inputs": [{"name": name, "type": kind, "link": None} for name, kind in link_inputs],
           "outputs": [{"name": name or kind, "type": "COMBO" if isinstance(kind, list) else kind, "links": None,
                        "slot_index": i} for i, (kind, name) in enumerate(zip(definition["output"], definition["output_name"]))],
           "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": values}
    title = node.get("_meta", {}).get("title")
    if title and title != definition["display_name"]:
        out["title"] = title
    return out


def api_to_ui(api: dict, object_info: dict) -> dict:
    """A UI workflow whose "Queue Prompt" sends exactly `api`: nodes laid out left to right by depth."""
    order = topological(api)
    depth, column_y, nodes, links = {}, {}, {}, []
    for index, key in enumerate(order):
        node = api[key]
        sources = [value[0] for value in node["inputs"].values() if is_link(value)]
        depth[key] = 1 + max((depth[s] for s in sources), default=-1)
        y = column_y.get(depth[key], 0)
        nodes[key] = ui_node(key, node, object_info[node["class_type"]], [40 + COLUMN * depth[key], 40 + y], index)
        column_y[depth[key]] = y + nodes[key]["size"][1] + GAP
        for slot, entry in enumerate(nodes[key]["inputs"]):
            source = node["inputs"].get(entry["name"])
            if source is not None:
                links.append([len(links) + 1, int(source[0]), source[1], int(key), slot, entry["type"]])
                entry["link"] = len(links)
                output = nodes[source[0]]["outputs"][source[1]]
                output["links"] = (output["links"] or []) + [len(links)]
    for node in nodes.values():
        if not node["inputs"]:
            del node["inputs"]
    return {"last_node_id": max(int(key) for key in api), "last_link_id": len(links),
            "nodes": [nodes[key] for key in order], "links": links, "groups": [], "config": {}, "extra": {},
            "version": 0.4}


def without_meta(api: dict) -> dict:
    """The graph alone (node types and inputs): what ComfyUI executes, and what the frontend sends outside dev mode."""
    return {key: {"class_type": node["class_type"], "inputs": node["inputs"]} for key, node in api.items()}

"""Check an API workflow against a server's /object_info: node types, input names, link types, widget values."""
from .workflow_formats import combo_options, is_link


def value_problem(name: str, spec: list, value):
    """Why `value` does not fit the input `spec` (None if it does)."""
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
    choices = combo_options(spec)
    if choices is not None:
        return None if value in choices else f"{name}={value!r} is not one of {choices[:12]}"
    expected = {"INT": int, "FLOAT": (int, float), "STRING": str, "BOOLEAN": bool}.get(kind)
    if expected is None:
        return f"{name} is a {kind} input and needs a link, not {value!r}"
    if not isinstance(value, expected) or (kind != "BOOLEAN" and isinstance(value, bool)):
        return f"{name}={value!r} is not a {kind}"
    if kind in ("INT", "FLOAT") and not options.get("min", value) <= value <= options.get("max", value):
        return f"{name}={value!r} is outside [{options.get('min')}, {options.get('max')}]"
    return None


def link_problem(workflow: dict, object_info: dict, name: str, spec: list, link: list):
    source = workflow.get(link[0])
    if source is None:
        return f"{name} links to node {link[0]}, which is not in the workflow"
    outputs = object_info.get(source["class_type"], {}).get("output", [])
    if link[1] >= len(outputs):
        return f"{name} links to output {link[1]} of {source['class_type']}, which has {len(outputs)}"
    if spec[0] != outputs[link[1]] and "*" not in (spec[0], outputs[link[1]]):
        return f"{name} wants {spec[0]} but node {link[0]} gives {outputs[link[1]]}"
    return None


def workflow_problems(workflow: dict, object_info: dict) -> list[str]:
    """Everything in `workflow` this server would not run as written (empty if it all fits)."""
    problems = []
    for key, node in workflow.items():
        definition = object_info.get(node["class_type"])
        if definition is None:
            problems.append(f"node {key}: {node['class_type']} is not a node type of this server")
            continue
        required = definition["input"].get("required", {})
        declared = {**required, **definition["input"].get("optional", {})}
        for name in sorted(set(required) - set(node["inputs"])):
            problems.append(f"node {key} ({node['class_type']}): required input {name} is missing")
        for name, value in node["inputs"].items():
            if name not in declared:
                problem = f"{name} is not an input of it (inputs: {sorted(declared)})"
            elif is_link(value):
                problem = link_problem(workflow, object_info, name, declared[name], value)
            else:
                problem = value_problem(name, declared[name], value)
            if problem:
                problems.append(f"node {key} ({node['class_type']}): {problem}")
    return problems

"""The tree reads engines -> core -> hosts -> nodes (README, Architecture): checked on the source, by the imports every
module makes (at its top and inside functions)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENGINES = ("compiler", "quantization", "step_cache", "attention", "parallel", "families")
HOSTS = ("comfy_host", "diffusers_api")
PRODUCT = (*ENGINES, "core", *HOSTS, "nodes")
NOT_PRODUCT = ("harness", "tests", "bench", "scripts")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["overdrive", *parts])


def imports_of(path: pathlib.Path) -> set:
    """The overdrive modules (or packages) `path` imports, resolved to absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("overdrive"):
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("overdrive"))
    return found


def product_modules() -> dict:
    files = [p for top in PRODUCT for p in (ROOT / top).rglob("*.py")]
    files += [p for p in ROOT.glob("*.py")]
    return {module_name(p): p for p in files}


MODULES = product_modules()


def exported(package: str) -> dict:
    """{name: module} of what a package's __init__ imports from its own modules (what `from package import name`
    reaches through it)."""
    out = {}
    for node in ast.parse(MODULES[package].read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.update({alias.asname or alias.name: f"{package}.{node.module}" for alias in node.names})
    return out


def resolved(imported: set) -> set:
    """The product modules that imported names come from: a module itself, the module a package's name comes from,
    else the package or module that defines the name."""
    out = set()
    for name in imported:
        owner, _, attribute = name.rpartition(".")
        if name in MODULES:
            out.add(name)
        elif owner in MODULES and MODULES[owner].name == "__init__.py" and attribute in exported(owner):
            out.add(exported(owner)[attribute])
        elif owner in MODULES:
            out.add(owner)
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_product_code_never_imports_the_test_and_bench_harness():
    offenders = {m: sorted(i for i in imports_of(p) if layer(i) in NOT_PRODUCT) for m, p in MODULES.items()}
    assert "overdrive.harness.inprocess" not in {m for i in MODULES.values() for m in resolved(imports_of(i))}
    assert not {m: i for m, i in offenders.items() if i}


@pytest.mark.parametrize("lower,upper", [(ENGINES, ("comfy_host", "diffusers_api", "nodes", "builtin_models")),
                                         (("core",), ("comfy_host", "diffusers_api", "nodes", "builtin_models")),
                                         (HOSTS, ("nodes",)), (("comfy_host",), ("diffusers_api",)),
                                         (("diffusers_api",), ("comfy_host",))])
def test_each_layer_imports_only_the_layers_below_it(lower, upper):
    offenders = {m: sorted(i for i in imports_of(p) if layer(i) in upper)
                 for m, p in MODULES.items() if layer(m) in lower}
    assert not {m: i for m, i in offenders.items() if i}


def test_no_import_cycle_between_modules():
    graph = {m: resolved(imports_of(p)) - {m} for m, p in MODULES.items()}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))
    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles


def test_nodes_holds_only_node_declarations():
    """Every module of nodes/ declares nodes (or their shared schema helper) and defines no other function: what a
    node does lives in the ComfyUI host (comfy_host/)."""
    for path in (ROOT / "nodes").glob("*.py"):
        tree = ast.parse(path.read_text())
        functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        if path.name == "schema.py":
            continue
        assert all(f in ("compile_settings",) for f in functions), (path.name, functions)
        assert path.name == "__init__.py" or classes, path.name

"""What a traced call read besides its arguments: kept with a guard-free precompiled frame (compiler/precompiled.py)
and checked in place of Dynamo's guards, which torch cannot save with ComfyUI's models.

Both records are built from the guards Dynamo produced while tracing (handed to the frame's guard_filter_fn):
- GlobalsRead: the functions and classes reached from modules (ComfyUI's attention function, torch's SDPA), by
  identity at every call and by name in a new process, so a node that monkey-patches one sends calls back to
  torch.compile.
- ValuesRead: the plain values the code read (module-level flags and constants such as ComfyUI's SDP_BATCH_LIMIT or a
  function's default argument, the model's own attributes), the types of its submodules, and (as torch.compile does
  when `torch._dynamo.config.skip_nnmodule_hook_guards` is off) that its hook dicts are empty. One generated function
  reads them all at every call and one tuple comparison checks them; a new process compares their printed forms with
  the saved ones before trusting a frame.
Not recorded: whether an instance attribute shadows its class's (a submodule given its own `forward` after tracing)
and aliasing between arguments (one tensor passed twice).
"""
import ast
import base64
import json
import marshal
import re
import sys
import types
import weakref

import torch

from ..core.weights_watch import weights_generation

# Dynamo's guards on code and classes read from globals; a saved frame drops them, GlobalsRead checks them instead.
_CODE_GUARDS = {"CLOSURE_MATCH", "FUNCTION_MATCH", "ID_MATCH", "CLASS_MATCH", "BUILTIN_MATCH"}
# Dynamo's guards on values, types and hook dicts; ValuesRead checks them instead.
_VALUE_GUARDS = {"CONSTANT_MATCH", "EQUALS_MATCH"}
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
# The parameters of the traced function (compiler/shared_graph._call_method): what a local guard source starts with.
_LOCALS = ("module", "method", "args", "kwargs")


class _Modules:
    """The `G` of Dynamo's guard sources, for the names that mean a module: `G['__import_a_dot_b']` is module a.b.
    Other names (builtins, globals Dynamo installed under ids of this process) raise KeyError: not watched."""

    def __getitem__(self, key):
        if not key.startswith("__import_"):
            raise KeyError(key)
        return sys.modules[key[len("__import_"):].replace("_dot_", ".")]


_G = _Modules()
_MODULES = {"G": _G}


def _resolve(code):
    """What a guard source (compiled with `compile(source, ..., "eval")`, or the source itself) names now; _GONE if
    it cannot be found."""
    try:
        return eval(code, _MODULES)  # noqa: S307 - Dynamo's own guard expressions
    except Exception:  # noqa: BLE001 - a module or attribute that is gone, a name that is not a module's
        return _GONE


def _name_of(value) -> str:
    """Where a function or class comes from, stable across processes (a patched one has another name or line)."""
    code = getattr(value, "__code__", None)  # a function's; on a class such as types.FunctionType, a descriptor
    line = f":{code.co_firstlineno}" if isinstance(code, types.CodeType) else ""
    return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}{line}"


class GlobalsRead:
    """The functions and classes a frame read from modules when it was traced, as (Dynamo guard source, name)
    pairs: `unchanged()` compares their identities at every call, `renamed()` their names in a new
    process, before a saved frame is trusted."""

    def __init__(self, entries):
        self.entries = [tuple(e) for e in entries]
        self.sources = [compile(source, "<dynamo guard source>", "eval") for source, _ in self.entries]
        self.values = [_resolve(source) for source in self.sources]
        # All of them read by one expression at each call (one eval each added up over a frame's dozens of entries),
        # unless one was already gone when traced (that entry then counts as unchanged while it stays gone).
        self._all = None if _GONE in self.values else compile(
            f"({''.join(f'({source}), ' for source, _ in self.entries)})", "<dynamo guard sources>", "eval")

    @classmethod
    def from_guards(cls, guard_entries):
        """Kept: code guards on something reached from modules that resolves to the guarded object."""
        entries = {(e.name, _name_of(e.value)) for e in guard_entries
                   if e.is_global and e.has_value and e.guard_type in _CODE_GUARDS and _resolve(e.name) is e.value}
        return cls(sorted(entries))

    def changed(self) -> list[str]:
        """The sources whose object is no longer the one traced (empty: the frame's code is what runs now)."""
        return [entry[0] for entry, source, value in zip(self.entries, self.sources, self.values)
                if _resolve(source) is not value]

    def unchanged(self) -> bool:  # at every call
        if self._all is None:
            return all(_resolve(source) is value for source, value in zip(self.sources, self.values))
        try:
            now = eval(self._all, _MODULES)  # noqa: S307 - Dynamo's own guard expressions
        except Exception:  # noqa: BLE001 - a module or attribute that is gone
            return False
        return all(read is value for read, value in zip(now, self.values))

    def renamed(self) -> list[str]:
        """In a new process: "source: saved name -> name now" for each object whose name differs from the saved one."""
        now = ["(gone)" if value is _GONE else _name_of(value) for value in self.values]
        return [f"{source}: {name} -> {current}" for (source, name), current in zip(self.entries, now) if current != name]


_GONE = object()

# How each kind of entry is read from its source, and printed to compare across processes.
_READ = {"value": "{}", "type": "type({})", "empty": "len({})"}


def _printed(kind: str, read) -> str:
    return _name_of(read) if kind == "type" else repr(read)


def _anchor(source: str) -> tuple[str | None, str]:
    """(anchor, rest): the longest prefix of a guard source that names a submodule of the model (ending in
    `._modules[...]`) or a Python module (`G[...]`), and the rest of the source after it. (None, source) for sources
    rooted elsewhere (the call's own arguments) or the model itself, which are read in full at every call."""
    tree = ast.parse(source, mode="eval").body
    node = tree
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        parent = node.func if isinstance(node, ast.Call) else node.value
        is_submodule = (isinstance(node, ast.Subscript) and isinstance(parent, ast.Attribute)
                        and parent.attr == "_modules")
        is_python_module = isinstance(node, ast.Subscript) and isinstance(parent, ast.Name) and parent.id == "G"
        if is_submodule or is_python_module:
            # The anchor's own text, cut where its node ends (a UTF-8 offset), not rebuilt by ast.unparse: SDXL's
            # frame has thousands of entries, anchored at every restart, where ast.unparse showed.
            if node.col_offset != 0 or node.end_lineno != 1:
                return None, source
            anchor = source.encode()[:node.end_col_offset].decode()
            return anchor, source[len(anchor):]
        node = parent
    return None, source


_STRUCTURE = re.compile(r"module(\._modules\[(?:'[^']*'|\"[^\"]*\")\])*(\._modules|\._parameters|\._buffers)?")


def _structural(kind: str, source: str) -> bool:
    """A type read of the model's module tree itself (a submodule, or one of its dicts of submodules, parameters or
    buffers): it changes only when a submodule is replaced, which weights_watch sees."""
    return kind == "type" and _STRUCTURE.fullmatch(source) is not None


class ValuesRead:
    """The plain values, types and empty hook dicts a frame read when it was traced, as (kind, Dynamo guard source,
    printed form) entries. `matches(call)` reads them for a call of the frame (module, method, args, kwargs) and
    compares them with what was read when the frame was built or, after a restart, first checked.

    Cost: a UNet's frame reads thousands of them. Read through their whole guard sources (chains of `_modules[...]`)
    they made SD1.5 on a fast GPU markedly slower per image (host-bound). So the submodules and Python modules they
    start from (anchors) are looked up once per model and module tree (again when another model calls, or a submodule
    or Parameter was replaced anywhere: weights_watch) and held weakly; each call reads the values from their anchors.
    The types of the submodules themselves (most of SD1.5's entries) change only with the tree, so they are read only
    when the anchors are looked up again (reading them all at each call showed in bench/host_timers.py). Not seen, as
    with the anchors: a module's `__class__` reassigned in place."""

    def __init__(self, entries, compiled=None):
        """`compiled`: `.compiled` of a ValuesRead of the same entries (saved with a frame), so that a restart neither
        parses nor compiles their sources again (most of the cost of anchoring a large frame)."""
        self.entries = [tuple(e) for e in entries]
        self.structural = [i for i, (kind, source, _) in enumerate(self.entries) if _structural(kind, source)]
        structural = set(self.structural)
        self.per_call = [i for i in range(len(self.entries)) if i not in structural]
        scope = {"type": type, "len": len, "ref": weakref.ref}
        if compiled is not None:
            exec(compiled, scope)  # noqa: S102 - defines the functions of _source() from Dynamo's own guard sources
        if "read_structure" not in scope:  # none saved, or saved before the structure was read apart
            compiled = compile(self._source(), "<overdrive value reads>", "exec")
            exec(compiled, scope)  # noqa: S102 - as above
        self.compiled = compiled
        self._find, self._read, self._read_structure = scope["find"], scope["read"], scope["read_structure"]
        self._anchored = None  # (the model, weights generation, its anchors): weak references all
        self._structure_ok = None  # whether the structure read as expected, since the anchors were last looked up
        self.expected = None  # (per-call values, structure) read at the last accepted check

    def _source(self) -> str:
        """Three functions: find the anchors; read the per-call entries from them; read the structural ones."""
        anchors: dict[str, int] = {}
        reads = []
        for kind, source, _ in self.entries:
            anchor, rest = _anchor(source)
            if anchor is None:
                reads.append(_READ[kind].format(source))
            else:
                index = anchors.setdefault(anchor, len(anchors))
                reads.append(_READ[kind].format(f"a{index}{rest}"))
        unpack = "".join(f"    a{i} = A[{i}]()\n" for i in range(len(anchors)))

        def reader(name, indices):
            return (f"def {name}(A, G, {', '.join(_LOCALS)}):\n" + unpack
                    + f"    return ({''.join(reads[i] + ', ' for i in indices)})\n")
        return (f"def find(G, module): return ({''.join(f'ref({a}), ' for a in anchors)})\n"
                + reader("read", self.per_call) + reader("read_structure", self.structural))

    def _anchors(self, module):
        generation = weights_generation()
        anchored = self._anchored
        if anchored is None or anchored[0]() is not module or anchored[1] != generation:
            anchored = self._anchored = (weakref.ref(module), generation, self._find(_G, module))
            self._structure_ok = None
        return anchored[2]

    def _read_parts(self, call) -> tuple[tuple, tuple]:
        anchors = self._anchors(call[0])
        return self._read(anchors, _G, *call), self._read_structure(anchors, _G, *call)

    def _read_call(self, call) -> tuple:
        """Every entry's value for `call`, in the entries' order."""
        return self._in_entry_order(*self._read_parts(call))

    def _in_entry_order(self, per_call: tuple, structure: tuple) -> tuple:
        values = [None] * len(self.entries)
        for indices, part in ((self.per_call, per_call), (self.structural, structure)):
            for i, value in zip(indices, part):
                values[i] = value
        return tuple(values)

    @classmethod
    def from_guards(cls, guard_entries, call) -> "ValuesRead":
        """Kept: value guards on plain values, type guards, and the empty-hooks guards of the traced modules. Raises
        ValueError if one of them cannot be read back from `call` (the traced call) as Dynamo saw it: such a frame
        could run while its code no longer applies, so it is not built."""
        entries = set()
        for e in guard_entries:
            if e.guard_type in _VALUE_GUARDS and e.has_value and type(e.value) in _PLAIN:
                entries.add(("value", e.name, _printed("value", e.value)))
            elif e.guard_type == "TYPE_MATCH" and e.has_value:
                entries.add(("type", e.name, _printed("type", type(e.value))))
            elif e.guard_type == "EMPTY_NN_MODULE_HOOKS_DICT" and not torch._dynamo.config.skip_nnmodule_hook_guards:
                # torch.compile itself ignores hooks added after compiling unless this is turned off: the same here
                entries.add(("empty", e.name, _printed("empty", 0)))
        try:
            read = cls(sorted(entries))
        except SyntaxError as error:
            raise ValueError(f"a guard source that is not an expression ({error})") from None
        differ = read.changed(call)
        if differ:
            raise ValueError(f"cannot read back what the traced code read: {differ[0]}")
        read.expected = read._read_parts(call)
        read._structure_ok = True
        return read

    def matches(self, call) -> bool:
        """At every call: one generated read and one tuple comparison; the structure too where the anchors were just
        looked up again (the first check after a restart compares printed forms instead)."""
        try:
            anchors = self._anchors(call[0])
            now = self._read(anchors, _G, *call)
            structure = (self._read_structure(anchors, _G, *call)
                         if self._structure_ok is None or self.expected is None else None)
        except Exception:  # noqa: BLE001 - an attribute or module that is gone: not what was traced
            return False
        if self.expected is None:
            read = self._in_entry_order(now, structure)
            if [_printed(kind, value) for (kind, _, _), value in zip(self.entries, read)] != [
                    printed for _, _, printed in self.entries]:
                return False
            self.expected, self._structure_ok = (now, structure), True
            return True
        if self._structure_ok is None:
            self._structure_ok = structure == self.expected[1]
        return self._structure_ok and now == self.expected[0]

    def changed(self, call) -> list[str]:
        """"source: traced -> now" for each entry that reads differently for this call (for the log)."""
        differ = []
        for kind, source, printed in self.entries:
            try:
                now = _printed(kind, eval(_READ[kind].format(source),  # noqa: S307 - as above
                                          {"G": _G, "type": type, "len": len}, dict(zip(_LOCALS, call))))
            except Exception as error:  # noqa: BLE001
                now = f"({type(error).__name__})"
            if now != printed:
                differ.append(f"{source}: {printed} -> {now}")
        return differ


def to_bytes(code: GlobalsRead, values: ValuesRead) -> bytes:
    """The entries, and the value reads' compiled functions for this Python (marshal's format is per version)."""
    compiled = {"tag": sys.implementation.cache_tag,
                "marshal": base64.b64encode(marshal.dumps(values.compiled)).decode()}
    return json.dumps({"code": code.entries, "values": values.entries, "values_compiled": compiled}).encode()


def from_bytes(data: bytes) -> tuple[GlobalsRead, ValuesRead]:
    saved = json.loads(data)
    return GlobalsRead(saved["code"]), ValuesRead(saved["values"], _saved_code(saved.get("values_compiled") or {}))


def _saved_code(compiled: dict):
    """The value reads' saved code object, or None (another Python's, or unreadable: compiled again from entries)."""
    if compiled.get("tag") != sys.implementation.cache_tag:
        return None
    try:
        code = marshal.loads(base64.b64decode(compiled["marshal"]))
    except (KeyError, ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, types.CodeType) else None

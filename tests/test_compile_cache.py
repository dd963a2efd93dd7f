"""The on-disk compile cache: a new process loads what an earlier one compiled; corrupt entries are rebuilt."""
import json
import logging
import marshal
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from overdrive.compiler import CompileDiskCache
from overdrive.compiler.disk_cache import compile_key
from overdrive.core.storage import device_identity

CHILD = pathlib.Path(__file__).with_name("compile_cache_child.py")


def run_child(cache_dir, inductor_dir, **env_vars):
    # A fresh Inductor cache folder per process: only Overdrive's own artifacts can make the second one warm. In a
    # fresh folder Inductor would also build and load-test its vector-ISA probes again (most of a cold process's
    # first compile), which is torch's business, not these tests': told the ISA works, it takes the best one the CPU
    # reports.
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_dir), TORCHINDUCTOR_VEC_ISA_OK="1", **env_vars)
    result = subprocess.run([sys.executable, str(CHILD), str(cache_dir)], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_a_restart_loads_an_entry_points_two_graphs_from_disk(tmp_path):
    """A new process loads what an earlier one compiled, with nothing left to compile. save_cache_artifacts() returns
    only what was compiled since its last call: an entry point's second graph is added to its entry, not written over
    the first (Z-Image on the H200 lowered a block graph again after a restart); a restart that only hit the cache
    adds nothing."""
    cold, _ = run_child(tmp_path / "cache", tmp_path / "inductor1", OVERDRIVE_TEST_TWO_SHAPES="1")
    assert cold["failure"] is None and cold["graphs"] == 2 and cold["misses"] == 2 and cold["hits"] == 0, cold
    entries = {p: p.stat().st_size for p in (tmp_path / "cache").glob("*.bin")}
    assert entries, "the first process saved nothing"
    warm, log = run_child(tmp_path / "cache", tmp_path / "inductor2", OVERDRIVE_TEST_TWO_SHAPES="1")
    assert warm["failure"] is None and warm["hits"] == 2 and warm["misses"] == 0, warm
    assert "loaded compiled artifacts" in log and warm["max_error"] < 1e-5
    assert {p: p.stat().st_size for p in (tmp_path / "cache").glob("*.bin")} == entries


def test_precompiled_restart_traces_nothing(tmp_path):
    """With precompile, the restarted process runs the saved frame: Dynamo traces nothing, for both checkpoints."""
    cold, log = run_child(tmp_path / "cache", tmp_path / "inductor1", OVERDRIVE_TEST_PRECOMPILE="1")
    assert cold["failure"] is None and cold["max_error"] < 1e-5, cold
    assert "precompiled forward" in log
    frames = list((tmp_path / "cache").glob("*.frames/*.bin"))
    assert len(frames) == 1, frames
    warm, log = run_child(tmp_path / "cache", tmp_path / "inductor2", OVERDRIVE_TEST_PRECOMPILE="1")
    assert warm["traced"] == 0 and warm["max_error"] < 1e-5, warm
    assert "loaded the precompiled frame" in log
    # The processes below compile again by design; Inductor's cache of the first one serves their kernels (what they
    # check is Overdrive's frame, which each sees as a fresh process does).
    # A corrupt frame is discarded with a warning; the process compiles (and saves a good frame) instead.
    frames[0].write_bytes(frames[0].read_bytes()[:-10])
    again, log = run_child(tmp_path / "cache", tmp_path / "inductor1", OVERDRIVE_TEST_PRECOMPILE="1")
    assert "discarding the precompiled frame" in log and again["max_error"] < 1e-5, again
    assert list((tmp_path / "cache").glob("*.frames/*.bin"))
    # A process where a module-level value the frame read differs (a flag set by a command-line option, say): the
    # saved frame is not used for those calls, torch.compile traces what runs now.
    scaled, log = run_child(tmp_path / "cache", tmp_path / "inductor1", OVERDRIVE_TEST_PRECOMPILE="1",
                            OVERDRIVE_TEST_SCALE="2")
    assert "SCALE: 1.0 -> 2.0 changed after this model was precompiled" in log, log[-2000:]
    assert scaled["traced"] >= 1 and scaled["max_error"] < 1e-5, scaled
    # A process where a node has patched a function the frame inlined: the saved frame is not used, the new code runs.
    patched, log = run_child(tmp_path / "cache", tmp_path / "inductor1", OVERDRIVE_TEST_PRECOMPILE="1",
                             OVERDRIVE_TEST_PATCH_GELU="1")
    assert "code it inlined changed" in log and "F.gelu" in log, log[-2000:]
    assert patched["traced"] >= 1 and patched["max_error"] < 1e-5, patched


def test_precompiled_frame_steps_aside_when_code_it_inlined_is_patched(tmp_path, caplog):
    """In one process: a node patching a function after the frame was built sends calls to torch.compile."""
    from overdrive.compiler import CompileOptions, compile_module

    original_gelu = torch.nn.functional.gelu
    try:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).requires_grad_(False)
        x = torch.randn(3, 8)
        compile_module(module, CompileOptions(precompile=True, cuda_graphs=False, cache_dir=str(tmp_path)))
        assert torch.allclose(module(x), torch.nn.functional.gelu(module[0](x)), atol=1e-5)
        torch.nn.functional.gelu = lambda t, approximate="none": torch.tanh(t)
        with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
            out = module(x)
        assert torch.allclose(out, torch.tanh(module[0](x)), atol=1e-5)
        assert "changed after this model was precompiled" in caplog.text
    finally:
        torch.nn.functional.gelu = original_gelu
    assert torch.allclose(module(x), original_gelu(module[0](x)), atol=1e-5)  # the frame again, as traced
    # Nothing Overdrive keeps for the frame holds the model it was traced on (the UNet a checkpoint change dropped
    # stayed in VRAM: 4.9 GiB for SDXL on the GPU).
    import gc
    import weakref
    gone = weakref.ref(module)
    del module
    gc.collect()
    assert gone() is None


SCALE = 2.0  # a module-level value the traced code below reads (as ComfyUI's code reads its own flags)


class ScaledByModuleValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.offset = 1.0

    def forward(self, x):
        return self.linear(x) * SCALE + self.offset


def test_precompiled_frame_steps_aside_when_a_value_it_read_changes(tmp_path, caplog):
    """A guard-free frame checks the plain values the traced code read, as Dynamo's guards would: a module-level value,
    an attribute of the model, a forward hook added later. While one differs, calls go through torch.compile (the
    output follows the change); when it reads as traced again, the frame runs again."""
    from overdrive.compiler import CompileOptions, compile_module

    global SCALE
    torch.manual_seed(0)
    module = ScaledByModuleValue().requires_grad_(False)
    x = torch.randn(3, 8)

    def eager():
        return module.linear(x) * SCALE + module.offset
    # Shapes left open as blocks have them (static_shapes="first_step"): room for more frames, yet a stale one is not
    # built again.
    compiled = compile_module(module, CompileOptions(precompile=True, cuda_graphs=False, cache_dir=str(tmp_path),
                                                     static_shapes="first_step"))
    assert torch.allclose(module(x), eager(), atol=1e-5)
    frames = compiled.graph.frames
    assert len(frames.frames) == 1 and frames.failure is None
    built = dict(frames.frames)
    try:
        with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
            SCALE = 3.0
            assert torch.allclose(module(x), eager(), atol=1e-5)
        assert "SCALE: 2.0 -> 3.0" in caplog.text, caplog.text
        assert frames.frames == built
    finally:
        SCALE = 2.0
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.allclose(module(x), eager(), atol=1e-5)  # the frame again: nothing traced
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == traced
    module.offset = 5.0  # the model's own attribute
    assert torch.allclose(module(x), eager(), atol=1e-5)
    module.offset = 1.0
    # A hook added after tracing is ignored, as torch.compile's own graphs ignore it (Dynamo skips hook guards by
    # default); with that switched off, a frame built then steps aside for it.
    _, _, values = next(iter(frames.frames.values()))
    assert not [entry for entry in values.entries if entry[0] == "empty"]
    torch.manual_seed(1)
    hooked = ScaledByModuleValue().requires_grad_(False)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):  # max_graphs: another graph, a new frame
        compiled = compile_module(hooked, CompileOptions(precompile=True, cuda_graphs=False, max_graphs=7))
        hooked(x)
    _, _, values = next(iter(compiled.graph.frames.frames.values()))
    handle = hooked.linear.register_forward_hook(lambda mod, inputs, out: out * 0)
    try:
        assert values.changed((hooked, "forward", (x,), {})) == ["module._modules['linear']._forward_hooks: 0 -> 1"]
        assert not values.matches((hooked, "forward", (x,), {}))
    finally:
        handle.remove()
    assert values.matches((hooked, "forward", (x,), {}))


def test_building_a_frame_forgets_the_guard_temporaries_torch_leaks():
    """torch's own ChainedSource.get_value, on a read that raises, leaves its `tmp` name (and the object) in Dynamo's
    process-wide guard closure variables; a frame build removes the names added since it began (on the H100 one held
    248 MiB of a dropped SDXL UNet's weights)."""
    import gc
    import weakref

    from torch._dynamo.guards import _get_closure_vars
    from torch._dynamo.source import AttrSource, LocalSource

    from overdrive.compiler.precompiled import GuardTemporaries

    block = torch.nn.Linear(2, 2)
    gone = weakref.ref(block)
    temporaries = GuardTemporaries()
    closure_vars = _get_closure_vars()
    with pytest.raises(AttributeError):
        AttrSource(LocalSource("block"), "missing").get_value({"L": {"block": block}}, closure_vars, {})
    assert any(value is block for value in closure_vars.values())  # torch leaked it
    temporaries.forget()
    assert not any(value is block for value in _get_closure_vars().values())
    assert "torch" in _get_closure_vars()  # torch's own names stay
    del block
    gc.collect()
    assert gone() is None


def test_a_frame_build_leaves_nothing_torch_leaked_while_filtering_guards(tmp_path, monkeypatch):
    """The same leak inside a real build. On the H100 a guard read raised by itself while torch made the guard filter's
    entries; no guard read fails on the CPU, so here each entry also makes one through torch's own get_value. After
    the build, nothing (the shared dict, the guards built from its copy) keeps the leaked object."""
    import gc
    import weakref

    import torch._dynamo.guards as guards
    from torch._dynamo.source import AttrSource, LocalSource

    from overdrive.compiler import CompileOptions, compile_module

    block = torch.nn.Linear(2, 2)
    gone = weakref.ref(block)
    leaked = []
    make_entry = guards.make_guard_filter_entry

    def make_entry_after_a_failed_read(guard, builder):
        closure_vars = guards._get_closure_vars()
        with pytest.raises(AttributeError):
            AttrSource(LocalSource("block"), "missing").get_value({"L": {"block": gone()}}, closure_vars, {})
        leaked.append(any(value is gone() for value in closure_vars.values()))
        return make_entry(guard, builder)

    monkeypatch.setattr(guards, "make_guard_filter_entry", make_entry_after_a_failed_read)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).requires_grad_(False)
    # An empty cache folder: the frame is built, not loaded.
    compile_module(module, CompileOptions(precompile=True, cuda_graphs=False, cache_dir=str(tmp_path)))
    x = torch.randn(3, 4)
    assert torch.allclose(module(x), torch.relu(module[0](x)), atol=1e-5)
    assert leaked and all(leaked)  # torch leaked the block while the frame was built
    del block
    gc.collect()
    assert gone() is None


def test_corrupt_entry_is_discarded_not_fatal(tmp_path, caplog):
    cache = CompileDiskCache(tmp_path)
    key = compile_key("f" * 16, {"mode": "default"}, torch.device("cpu"))
    tmp_path.mkdir(exist_ok=True)
    cache.path(key).write_bytes(b"OVDRV001" + b"\0" * 40 + b"truncated")
    with caplog.at_level(logging.WARNING, logger="overdrive.compiler"):
        assert cache.load(key) is False
    assert not cache.path(key).exists()
    assert any("discarding" in r.getMessage() for r in caplog.records)


def test_key_changes_with_device_and_software():
    cpu = device_identity(torch.device("cpu"))
    assert cpu["torch"] == torch.__version__ and cpu["gpu"] is None
    a = compile_key("f" * 16, {"mode": "default"}, torch.device("cpu"))
    assert a != compile_key("f" * 16, {"mode": "max-autotune"}, torch.device("cpu"))
    assert a != compile_key("e" * 16, {"mode": "default"}, torch.device("cpu"))


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on loopback (Debian's package; scripts/install.sh --tests installs it)."""
    import shutil
    import socket
    import time

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed: run scripts/install.sh --tests"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}/0", client
    process.terminate()
    process.wait(timeout=10)


def test_a_fleet_compiles_once_through_redis(tmp_path, redis_server):
    url, client = redis_server
    # Two "workers": no shared disk, no Overdrive disk cache, fresh Inductor folders; only Redis is shared.
    first, _ = run_child("none", tmp_path / "worker1", OVERDRIVE_REDIS_URL=url)
    assert first["failure"] is None and first["misses"] >= 1
    assert client.dbsize() > 0, "nothing was written to Redis"
    second, log = run_child("none", tmp_path / "worker2", OVERDRIVE_REDIS_URL=url)
    assert second["failure"] is None and second["hits"] >= 1 and second["misses"] == 0, second
    assert "sharing compiled artifacts through Redis" in log


def test_precompiled_call_signature_keys_what_a_guard_free_frame_is_specialised_on():
    import uuid

    from overdrive.compiler.precompiled import call_signature

    x = torch.zeros(2, 4, 8, 8)
    options = {"cond_or_uncond": [1, 0], "sigmas": torch.ones(2), "uuids": [uuid.uuid4()], "patches": {}}
    base = call_signature("forward", (x,), {"transformer_options": options})
    assert base is not None
    # Ids are keyed by type: ComfyUI makes new ones for every prompt.
    assert call_signature("forward", (x,), {"transformer_options": {**options, "uuids": [uuid.uuid4()]}}) == base
    for changed in ((torch.zeros(2, 4, 8, 16),), (x.half(),), (x.to(memory_format=torch.channels_last),)):
        assert call_signature("forward", changed, {"transformer_options": options}) != base
    assert call_signature("forward", (x,), {"transformer_options": {**options, "cond_or_uncond": [0, 1]}}) != base
    assert call_signature("shallow_forward", (x,), {"transformer_options": options}) != base
    # A function (an attention patch) cannot be keyed: that call goes through torch.compile and its guards.
    patched = {**options, "patches": {"attn1_patch": [lambda q, k, v, extra: (q, k, v)]}}
    assert call_signature("forward", (x,), {"transformer_options": patched}) is None


def test_a_record_of_tensors_is_keyed_by_its_class_and_fields():
    """Chroma hands its blocks Flux's ModulationOut records (a dataclass of shift, scale and gate tensors)."""
    import dataclasses

    from overdrive.compiler.precompiled import call_signature

    @dataclasses.dataclass
    class Modulation:
        shift: torch.Tensor
        gate: torch.Tensor

    @dataclasses.dataclass
    class Other:
        shift: torch.Tensor
        gate: torch.Tensor

    x, v = torch.zeros(1, 16, 8), torch.zeros(1, 1, 8)
    base = call_signature("forward", (x,), {"vec": (Modulation(v, v), Modulation(v, v))})
    assert base is not None
    assert call_signature("forward", (x,), {"vec": (Modulation(v + 1, v), Modulation(v, v))}) == base  # values: inputs
    assert call_signature("forward", (x,), {"vec": (Modulation(v.half(), v), Modulation(v, v))}) != base
    assert call_signature("forward", (x,), {"vec": (Other(v, v), Modulation(v, v))}) != base
    assert call_signature("forward", (x,), {"vec": (Modulation(v, lambda: v), Modulation(v, v))}) is None


def test_precompiled_frames_are_keyed_by_the_model_code():
    from overdrive.compiler.precompiled import code_digest
    mlp = code_digest(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()))
    assert code_digest(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())) == mlp  # same classes, same code
    assert code_digest(torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.GELU())) != mlp


def test_precompiled_frames_run_only_with_every_weight_on_the_input_device():
    """A guard-free frame must not run with weights elsewhere (ComfyUI's low-VRAM mode leaves some on the CPU). The
    check keeps its list of modules between calls: it must still see a moved parameter, a moved buffer, a replaced
    Parameter and a swapped-in submodule."""
    from overdrive.compiler.precompiled import weights_on

    cpu = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    assert weights_on(model, cpu)
    model[2].to("meta")  # a device move swaps tensors in place: no registration hook fires
    assert not weights_on(model, cpu)
    model[2].to_empty(device=cpu)
    assert weights_on(model, cpu)
    model[1].running_mean = torch.zeros(4, device="meta")  # a buffer
    assert not weights_on(model, cpu)
    model[1].running_mean = torch.zeros(4)
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))  # a Parameter replaced (a LoRA patch)
    assert not weights_on(model, cpu)
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 4))
    assert weights_on(model, cpu)
    model[2] = torch.nn.Linear(4, 4, device="meta")  # a submodule swapped (QuantizeModel, SwitchWeights)
    assert not weights_on(model, cpu)


def test_the_weight_device_check_keeps_no_model_alive():
    """Its list of modules is kept per model between calls; a model nobody else holds (the UNet a SwitchWeights
    replaced) must still be freed."""
    import gc
    import weakref

    from overdrive.compiler.precompiled import weights_on

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert weights_on(model, torch.device("cpu"))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_call_is_keyed_by_the_wrappers_its_forward_runs_not_by_the_samplers(comfy):
    """ComfyUI copies a model's wrappers into transformer_options; only the diffusion model's own ("diffusion_model")
    run inside the forward. A sampler wrapper (Overdrive's conds_on_device) leaves the call precompilable."""
    from overdrive.comfy_host.comfy_call_options import COMFY_CALL_OPTIONS
    from overdrive.compiler.precompiled import call_signature

    def wrapper(executor, *args, **kwargs):
        return executor(*args, **kwargs)

    def signature(options):  # as the ComfyUI host keys a call: with its description of transformer_options
        return call_signature("forward", (x,), {"transformer_options": options}, COMFY_CALL_OPTIONS.inert)
    x = torch.zeros(1, 4, 8, 8)
    plain = signature({"wrappers": {}})
    around = signature({"wrappers": {"sampler_sample": {"overdrive_conds_on_device": [wrapper]},
                                     "outer_sample": {"x": [wrapper]}}})
    inside = signature({"wrappers": {"diffusion_model": {"someone": [wrapper]}}})
    assert plain is not None and around == plain
    assert inside is None  # a function the forward calls: not keyable, so torch.compile's guarded path runs it


def test_value_reads_are_anchored_at_the_deepest_submodule_or_python_module_they_name():
    """ValuesRead looks each anchor up once per model and reads the rest from it at every call; whatever is not rooted
    at a submodule or a module (the call's own arguments, a call around the source) is read in full."""
    from overdrive.compiler.traced_reads import ValuesRead, _anchor

    assert _anchor("module._modules['down']._modules['0'].heads") == ("module._modules['down']._modules['0']", ".heads")
    assert _anchor("G['__import_comfy_dot_ops'].SDP_LIMIT") == ("G['__import_comfy_dot_ops']", ".SDP_LIMIT")
    assert _anchor('G["__import_x"].y') == ('G["__import_x"]', ".y")
    assert _anchor("module._modules['é']._modules['b'].scale") == ("module._modules['é']._modules['b']", ".scale")
    assert _anchor("L['kwargs']['transformer_options']['patches']") == (
        None, "L['kwargs']['transformer_options']['patches']")
    assert _anchor("module.training") == (None, "module.training")

    class Inner(torch.nn.Module):
        heads = 4
    outer = torch.nn.Module()
    outer.add_module("é", Inner())
    read = ValuesRead([("value", "module._modules['é'].heads", "4"), ("type", "module._modules['é']", "x")])
    now = read._read_call((outer, "forward", (), {}))
    assert now == (4, Inner)


def model_with_heads():
    """(a module with one submodule "a", the submodule's class (fresh at each call, with a class attribute heads = 4),
    a call of the module as precompiled frames see it)."""
    inner = type("Inner", (torch.nn.Module,), {"heads": 4})
    outer = torch.nn.Module()
    outer.add_module("a", inner())
    return outer, inner, (outer, "forward", (), {})


def test_value_reads_check_the_module_tree_s_types_only_when_the_tree_changed():
    """The types of the submodules are read again only after a submodule was replaced (weights_watch); plain values and
    hook dicts at every call. A replaced submodule of another class, and a changed value, each fail the check."""
    from overdrive.compiler.traced_reads import ValuesRead

    outer, Inner, call = model_with_heads()
    Other = type("Other", (torch.nn.Module,), {"heads": 4})
    entries = [("value", "module._modules['a'].heads", "4"), ("type", "module._modules['a']", "x"),
               ("type", "module._modules['a']._parameters", "x"), ("type", "module._modules['a'].forward", "x"),
               ("empty", "module._modules['a']._forward_hooks", "0")]
    read = ValuesRead(entries)
    assert [read.entries[i][1] for i in read.structural] == ["module._modules['a']", "module._modules['a']._parameters"]
    read.expected = read._read_parts(call)
    read._structure_ok = True
    structure_reads = []
    original = read._read_structure
    read._read_structure = lambda *args: structure_reads.append(1) or original(*args)
    assert read.matches(call) and read.matches(call) and not structure_reads  # nothing replaced since the last look

    outer.a = Other()  # a registration: the structure is read again, and differs
    assert not read.matches(call) and not read.matches(call) and len(structure_reads) == 1
    outer.a = Inner()  # back to the traced class
    assert read.matches(call) and len(structure_reads) == 2
    Inner.heads = 8  # a plain value: read at every call
    assert not read.matches(call)
    Inner.heads = 4
    handle = outer.a.register_forward_hook(lambda *args: None)
    assert not read.matches(call)
    handle.remove()
    assert read.matches(call) and len(structure_reads) == 2


def test_value_reads_restart_from_their_saved_compiled_functions_and_rebuild_when_those_do_not_fit():
    """A saved frame keeps its value reads' compiled functions for this Python: a restart neither parses nor compiles
    them again. Another Python's (or an unreadable) copy is ignored and the reads are compiled from the entries."""
    import base64
    import json as json_module

    from overdrive.compiler.traced_reads import GlobalsRead, ValuesRead, from_bytes, to_bytes

    outer, Inner, call = model_with_heads()
    entries = [("value", "module._modules['a'].heads", "4"), ("type", "module._modules['a']", "x"),
               ("empty", "module._modules['a']._forward_hooks", "0")]
    saved = json_module.loads(to_bytes(GlobalsRead([]), ValuesRead(entries)))

    _, restored = from_bytes(json_module.dumps(saved).encode())
    assert restored.compiled is not None and restored._read_call(call) == (4, Inner, 0)
    # Saved before the structure was read apart: no read_structure among the saved functions.
    older = compile("def find(G, module): return ()\ndef read(A, G, module, method, args, kwargs): return ()", "<x>",
                    "exec")
    for broken in ({"tag": "cpython-0"}, {"marshal": base64.b64encode(b"junk").decode()},
                   {"marshal": base64.b64encode(marshal.dumps(older)).decode()}):
        copy = dict(saved, values_compiled=dict(saved["values_compiled"], **broken))
        _, rebuilt = from_bytes(json_module.dumps(copy).encode())
        assert rebuilt._read_call(call) == (4, Inner, 0)
    Inner.heads = 8  # the reads are live, not what was saved
    assert restored._read_call(call) == (8, Inner, 0)


def test_globals_read_sees_a_replaced_function_and_keeps_an_entry_gone_since_tracing_as_unchanged():
    """One expression reads every function a frame took from modules; an entry that was already gone when traced
    (a module since unloaded) keeps the per-entry check, where gone-and-still-gone is unchanged."""
    import math

    from overdrive.compiler.traced_reads import GlobalsRead

    entries = [("G['__import_math'].floor", "math.floor"), ("G['__import_math'].ceil", "math.ceil")]
    read = GlobalsRead(entries)
    assert read._all is not None and read.unchanged()
    original = math.floor
    try:
        math.floor = lambda x: 0
        assert not read.unchanged() and read.changed() == ["G['__import_math'].floor"]
    finally:
        math.floor = original
    assert read.unchanged()
    gone = GlobalsRead([*entries, ("G['__import_no_such_module'].f", "no_such_module.f")])
    assert gone._all is None and gone.unchanged()


def test_globals_read_names_a_class_whose_code_attribute_is_a_descriptor():
    """A frame may read a class such as types.FunctionType (Quantize Model's layers did), whose `__code__` is a
    descriptor, not code: it is named by module and name, and the frame is saved (it once failed with
    "'getset_descriptor' object has no attribute 'co_firstlineno'", and a restart traced the model again)."""
    import types

    from overdrive.compiler.traced_reads import GlobalsRead

    read = GlobalsRead([("G['__import_types'].FunctionType", "types.function")])
    assert read.unchanged() and read.renamed() == ["G['__import_types'].FunctionType: types.function -> "
                                                   "builtins.function"]


def test_a_specialised_shape_called_with_other_settings_gets_its_own_frame(tmp_path):
    """Once the first shapes are sealed, a call of a known shape with another plain argument (another model of the
    architecture with other settings) still gets a precompiled frame; a new shape takes torch.compile's path."""
    from overdrive.compiler import CompileOptions, compile_module

    class Scaled(torch.nn.Module):
        def forward(self, x, scale=1.0):
            return torch.relu(x) * scale

    module = Scaled()
    compiled = compile_module(module, CompileOptions(precompile=True, cuda_graphs=False, cache_dir=str(tmp_path)))
    x = torch.randn(4, 8)
    assert torch.equal(module(x, scale=1.0), torch.relu(x))
    assert compiled.graph.shapes_sealed and len(compiled.graph.frames.frames) == 1
    assert torch.equal(module(x, scale=2.0), torch.relu(x) * 2)
    assert len(compiled.graph.frames.frames) == 2
    y = torch.randn(5, 8)
    for _ in range(2):  # a later shape, again: the dynamic policy's graph, never a frame
        assert torch.equal(module(y, scale=2.0), torch.relu(y) * 2)
    assert len(compiled.graph.frames.frames) == 2


def test_a_stop_while_a_finished_compile_is_saved_lands_after_its_frame_is_on_disk(comfy, tmp_path, monkeypatch,
                                                                                   caplog):
    """The user stops while the frame of a compile that has finished is being written (a large model's takes a while):
    the write completes and the stop lands after it (the prompt still ends stopped), so a restart loads the frame
    instead of compiling again. (A stop used to land mid-write: the frame ran from memory but never reached disk.)"""
    import time

    import comfy.model_management as management
    import comfy.utils
    from overdrive.compiler import CompileOptions, clear_shared_graphs, compile_module, dynamo_graph_count, precompiled
    from overdrive.comfy_host.progress import comfy_progress

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8)).requires_grad_(False)
    options = CompileOptions(precompile=True, cuda_graphs=False, cache_dir=str(tmp_path))
    write = precompiled.write_framed

    def write_while_stopped(path, payload):
        management.interrupt_current_processing(True)  # POST /interrupt as the frame's write begins
        time.sleep(1.5)  # the progress heartbeat (every 0.5 s) tries to raise the stop meanwhile
        write(path, payload)
    monkeypatch.setattr(precompiled, "write_framed", write_while_stopped)
    hook = comfy.utils.PROGRESS_BAR_HOOK  # as ComfyUI's server installs it: an update raises a pending stop
    comfy.utils.set_progress_bar_global_hook(lambda *args, **kwargs: management.throw_exception_if_processing_interrupted())
    module, x = model(), torch.randn(3, 8)
    try:
        compile_module(module, options, reporter=comfy_progress)
        with pytest.raises(management.InterruptProcessingException):
            module(x)
    finally:
        comfy.utils.set_progress_bar_global_hook(hook)
        management.interrupt_current_processing(False)
    monkeypatch.undo()
    assert len(list(tmp_path.glob("*.frames/*.bin"))) == 1
    clear_shared_graphs()  # a restart, as far as Overdrive's frames go: nothing of them in memory
    restarted = model()
    compile_module(restarted, options)
    graphs = dynamo_graph_count()
    with caplog.at_level(logging.INFO, logger="overdrive.compiler"):
        out = restarted(x)
    assert "loaded the precompiled frame" in caplog.text and dynamo_graph_count() == graphs
    assert torch.allclose(out, restarted[2](restarted[1](restarted[0](x))), atol=1e-5)

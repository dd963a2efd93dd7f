"""Host wall time spent inside chosen functions during one sampling run, with no profiler's per-call overhead (cProfile
inflates code made of many small calls several times over): each target is wrapped with perf_counter.

Times are inclusive: a target that waits for the GPU (a blocking read) counts the wait as its own. Installed before
any model is built, since ComfyUI keeps bound methods as callbacks (QuantizedModules.on_cleanup) from install time.
"""
import functools
import importlib
import time
from collections import defaultdict

# "module:attribute path". Calls between the ones listed are not timed; the run's wall time is printed beside them.
TARGETS = (
    "comfy.model_management:load_models_gpu",
    "comfy.model_patcher:ModelPatcher.partially_load",
    "comfy.model_patcher:ModelPatcher.patch_model",
    "comfy.model_patcher:ModelPatcher.unpatch_model",
    "comfy.model_patcher:ModelPatcher.detach",
    "comfy.model_patcher:ModelPatcher.cleanup",
    "comfy.model_management:get_free_memory",
    "comfy.samplers:calc_cond_batch",
    "comfy.model_base:BaseModel.apply_model",
    "overdrive.comfy_host.quantized_follower:QuantizedModules.to",
    "overdrive.comfy_host.quantized_follower:QuantizedModules.on_cleanup",
    "overdrive.step_cache.runner:DeepCacheRunner.__call__",
    "overdrive.step_cache.runner:DeepCacheRunner._read",
    "overdrive.step_cache.unet_openai:OpenAIUNetPaths.inspect",
    "overdrive.compiler.compiled_method:CompiledMethod.__call__",
    "overdrive.compiler.shared_graph:SharedGraph.call",
    "overdrive.compiler.shared_graph:SharedGraph._precompiled_frame",
    "overdrive.compiler.shared_graph:SharedGraph._run_frame",
    "overdrive.compiler.shared_graph:_own_copy",
    "overdrive.compiler.precompiled:weights_on",
    "overdrive.compiler.precompiled:PrecompiledFrames.load",
    "overdrive.compiler.traced_reads:GlobalsRead.unchanged",
    "overdrive.compiler.traced_reads:ValuesRead.matches",
    "torch._inductor.cudagraph_trees:CUDAGraphTreeManager.run",
)


class HostTimers:
    def __init__(self, targets=TARGETS):
        self.enabled = False
        self.calls = defaultdict(int)
        self.seconds = defaultdict(float)
        self.missing = []
        for target in targets:
            self._wrap(target)

    def _wrap(self, target: str) -> None:
        module_name, path = target.split(":")
        try:
            owner = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            original = getattr(owner, name)
        except (ImportError, AttributeError):
            self.missing.append(target)  # another ComfyUI or Overdrive version: the rest are still timed
            return

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[path] += time.perf_counter() - start
                self.calls[path] += 1
        setattr(owner, name, timed)

    def run(self, fn, steps: int) -> dict:
        """Time one call of `fn` (a sampling run); prints and returns {target: [calls, ms in the run]}."""
        self.calls.clear()
        self.seconds.clear()
        self.enabled = True
        start = time.perf_counter()
        try:
            fn()
        finally:
            self.enabled = False
        wall = time.perf_counter() - start
        print(f"Host time inside each target in one run of {steps} steps (wall {wall * 1e3:.1f} ms; inclusive times)")
        rows = {path: [self.calls[path], round(self.seconds[path] * 1e3, 3)] for path in self.seconds}
        for path, (calls, ms) in sorted(rows.items(), key=lambda item: -item[1][1]):
            print(f"  {ms:9.2f} ms  x{calls:<5d} {ms / calls:8.3f} ms/call  {path}")
        if self.missing:
            print("  not found (not timed):", ", ".join(self.missing))
        return {"wall_ms": round(wall * 1e3, 2), "targets": rows}

"""What Overdrive installed on a module's forward (a CompiledMethod, a DeepCacheRunner, or nothing), and how each API
function composes with what is already there: compile_ then deepcache_ (or the other way round) compiles DeepCache's
two paths; quantize_ calibrates on the eager forward and re-fingerprints compiled code for the new layers."""
import contextlib

from ..compiler import CompiledMethod, CompileOptions
from ..deepcache import DeepCacheRunner


def installed(module, method: str = "forward"):
    """The instance-level replacement of `module.<method>` (ours or anyone's), or None."""
    return module.__dict__.get(method)


def runner_of(module) -> DeepCacheRunner | None:
    current = installed(module)
    return current if isinstance(current, DeepCacheRunner) else None


def compile_options_of(module) -> CompileOptions | None:
    """The options `module.forward` is compiled with (directly, or as a DeepCache runner's native forward)."""
    current = installed(module)
    if isinstance(current, DeepCacheRunner):
        current = current.native
    return current.options if isinstance(current, CompiledMethod) else None


def compiled_runner_parts(runner: DeepCacheRunner, module, options: CompileOptions) -> dict:
    """New compiled callables for a runner: its native forward and both paths (not installed yet)."""
    return {"native": CompiledMethod(module, "forward", options),
            "full_path": CompiledMethod(runner.paths, "full_forward", options),
            "shallow_path": CompiledMethod(runner.paths, "shallow_forward", options)}


def install_runner_parts(runner: DeepCacheRunner, parts: dict) -> None:
    for attribute, value in parts.items():
        setattr(runner, attribute, value)


@contextlib.contextmanager
def eager_forward(module):
    """Run `module`'s own class forward inside the block (calibration must see every layer, uncompiled)."""
    current = module.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if current is not None:
            module.forward = current


def recompile_after_swap(module) -> None:
    """After layers were swapped (quantized), compiled forwards get a fingerprint of the new structure, so graphs
    are shared only with modules that really have it."""
    options = compile_options_of(module)
    if options is None:
        return
    runner = runner_of(module)
    if runner is None:
        module.forward = CompiledMethod(module, "forward", options)
    else:
        install_runner_parts(runner, compiled_runner_parts(runner, module, options))

"""What every benchmark script reports the same way: the machine and versions, speed-ups, the table, the JSON."""
import collections
import json
import pathlib
import platform
import time

import torch


def environment() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda,
            "comfyui": comfyui_version()}
    if torch.cuda.is_available():
        import triton
        info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    triton=triton.__version__)
    return info


def copy_rates(gib: float = 1.0) -> dict:
    """Host-to-device copy rates of this machine, GB/s, from pinned and from pageable memory (the median of 5 copies
    of `gib` GiB): what streaming weights costs here, beside the figures measured with them."""
    import statistics
    rates = {}
    device = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    for kind, pinned in (("pinned", True), ("pageable", False)):
        host = torch.empty(device.numel(), dtype=torch.uint8, pin_memory=pinned)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            device.copy_(host, non_blocking=pinned)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        rates[f"h2d_{kind}_gb_s"] = round(device.numel() / statistics.median(times) / 1e9, 1)
    return rates


def comfyui_version():
    """The imported ComfyUI's version and whether it runs dynamic VRAM (None without ComfyUI)."""
    import sys
    if "comfy" not in sys.modules:
        return None
    import comfy.memory_management
    try:
        import comfyui_version
        version = comfyui_version.__version__
    except ImportError:
        version = "unknown"
    return {"version": version, "dynamic_vram": bool(getattr(comfy.memory_management, "aimdo_enabled", False))}


def add_speedups(rows: list) -> None:
    """speedup_vs_eager on every row, against the row whose variant is 'eager' (None when there is none)."""
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    for r in rows:
        r["speedup_vs_eager"] = round(eager["s_per_image"] / r["s_per_image"], 3) if eager else None


def finish(report: dict, rows: list, columns: list, out=None) -> None:
    """Print `rows` as a Markdown table (`columns`: (header, row -> text)), then the environment; write `report`."""
    print("\n| " + " | ".join(header for header, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(cell(r)) for _, cell in columns) + " |")
    print(json.dumps(report["environment"]))
    write_report(report, out)


def write_report(report: dict, out=None) -> None:
    """The report as JSON at `out` (if given), folders created."""
    if out:
        pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(out).write_text(json.dumps(report, indent=2))


def compile_phases(min_s: float = 0.5) -> dict:
    """Seconds per torch.compile phase (Dynamo tracing, AOTAutograd, Inductor lowering/codegen, guards, autotuning)
    since the last call, the phases of at least `min_s`; then starts counting afresh."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    phases = {name: round(sum(times), 2) for name, times in metrics.items() if sum(times) >= min_s}
    metrics.clear()
    return dict(sorted(phases.items(), key=lambda item: -item[1]))


def profile_run(run, steps, launchers: bool = False):
    """Where the time goes: CUDA kernel time of one sampling run, grouped by kernel family, and the top kernels; with
    `launchers`, the host ops that launched each of them (CPU ops are recorded too, which slows the run)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if launchers else [])
    with profile(activities=activities) as prof:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) or 1
    busy = gpu_busy_seconds(prof)
    print(f"\nOne run under the profiler: wall {wall:.3f} s, GPU busy {busy:.3f} s, GPU idle {wall - busy:.3f} s "
          f"({100 * (wall - busy) / wall:.0f} %: the host's share, not hidden behind GPU work)")
    families = {}
    for e in events:
        family = kernel_family(e.key)
        families[family] = families.get(family, 0) + e.self_device_time_total
    print(f"\nCUDA time of one run ({steps} steps): {total / 1e6:.3f} s")
    for family, t in sorted(families.items(), key=lambda kv: -kv[1]):
        print(f"  {family:14s} {t / 1e6:7.3f} s  {100 * t / total:5.1f} %")
    launched_by = kernel_launchers(prof) if launchers else {}
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / 1e3:9.1f} ms  x{e.count:<5d} {e.key[:110]}")
        if launchers:
            ops = launched_by.get(e.key, collections.Counter())
            for op, count in ops.most_common(3):
                print(f"{'':22s}launched by {op[:100]} (x{count})")
            if e.count > sum(ops.values()):  # a graph replays its kernels with no host op around each
                print(f"{'':22s}x{e.count - sum(ops.values())} with no host op (CUDA-graph replays)")
    print_idle_gaps(prof)


def kernel_launchers(prof) -> dict:
    """kernel name -> Counter of the innermost host ops that launched it (a copy, a custom op, a compiled graph);
    the CUDA runtime's own events (launch calls, a full command buffer) are not ops."""
    launched_by = {}
    for e in prof.events():
        if (e.device_type == torch.autograd.DeviceType.CPU and e.kernels
                and not e.name.startswith(("cuda", "Command Buffer"))):
            for kernel in e.kernels:
                launched_by.setdefault(kernel.name, collections.Counter())[e.name] += 1
    return launched_by


def print_idle_gaps(prof, min_us: float = 20.0, top: int = 12):
    """Where the GPU waits: its idle gaps of at least `min_us` between kernels, summed by the kernels on either side,
    and the host's blocking calls (synchronizations, copies to the host) that may cause them."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    gaps, end, last = {}, None, None
    for e in kernels:
        if end is not None and e.time_range.start - end >= min_us:
            key = (last.name[:60], e.name[:60])
            total, count = gaps.get(key, (0.0, 0))
            gaps[key] = (total + e.time_range.start - end, count + 1)
        if end is None or e.time_range.end > end:
            end, last = e.time_range.end, e
    total = sum(t for t, _ in gaps.values())
    print(f"\nGPU idle gaps of >= {min_us:g} us: {total / 1e6:.3f} s in {sum(c for _, c in gaps.values())} gaps; "
          "largest by the kernels before -> after:")
    for (before, after), (t, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {t / 1e3:8.1f} ms  x{count:<5d} {before} -> {after}")
    blocking = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and any(
                word in e.name for word in ("Synchronize", "Memcpy", "local_scalar_dense", "EventQuery")):
            t, count = blocking.get(e.name, (0.0, 0))
            blocking[e.name] = (t + e.time_range.end - e.time_range.start, count + 1)
    for name, (t, count) in sorted(blocking.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  host {name[:70]}: {t / 1e3:.1f} ms in {count} calls")


def sync_sources(run, top: int = 12):
    """Where one run blocks the host on the GPU: every synchronizing CUDA call torch sees (`.item()`, a copy to the
    host, a tensor used as a Python bool...), counted by its Python call stack. After such a call the GPU idles until
    the host has launched the next work, so one a step shows as idle time in the profile."""
    import traceback
    import warnings
    sources = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        sources[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                            for f in reversed(frames[-8:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"\nSynchronizing calls in one run: {sum(sources.values())}")
    for stack, count in sources.most_common(top):
        print(f"  x{count:<4d} {stack}")


def gpu_busy_seconds(prof) -> float:
    """Length of the union of all GPU activity intervals (kernels, copies) in a profile."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, None
    for lo, hi in intervals:
        if end is None or lo > end:
            busy += hi - lo
            end = hi
        elif hi > end:
            busy += hi - end
            end = hi
    return busy / 1e6


# Checked in this order. Inductor names a fused kernel after the ops it holds, so a cast fused for an fp8 GEMM is
# "triton_poi_fused__scaled_mm_..."; its templates (max-autotune) are "triton_tem_*" / "triton_mm_*". cuDNN's
# convolutions are "sm90_xmma_fprop_implicit_gemm_*", GEMMs by name too.
_FAMILIES = (("attention", ("flash", "fmha", "attention", "sdpa")),
             ("gemm", ("triton_tem_", "triton_mm_", "triton_bmm_")),
             ("triton fused", ("triton_",)),
             ("conv", ("conv", "fprop", "implicit", "cudnn")),
             ("gemm", ("gemm", "cutlass", "nvjet", "mm_")))


def kernel_family(kernel_name: str) -> str:
    """The family a CUDA kernel's time is reported under: attention, gemm, conv, triton fused or other."""
    name = kernel_name.lower()
    return next((family for family, keys in _FAMILIES if any(k in name for k in keys)), "other")

"""What every benchmark script reports the same way: the machine and versions, speed-ups, the table, the JSON."""
import json
import pathlib
import platform

import torch


def environment() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        import triton
        info.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    triton=triton.__version__)
    return info


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

"""The iteration soak on the CPU (bench/iteration_soak.py at the tiny Flux's size, in a process of its own, as the GPU
runs it): ComfyUI's own prompt executor and output cache, two cycles of LoRA, prompt, size and model changes, stops,
/free and a restart. Every prompt ends as it should, a LoRA change neither calibrates nor compiles, the second cycle
holds no more host memory than the first, and ComfyUI reports no leak."""
import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
UNCHANGED_STRUCTURE = ("LoRA 0.4 (strength change)", "LoRA 0.4, next seed", "another LoRA file", "LoRA removed",
                       "prompt changed", "size back", "back to the first file")


def start_early(workdir):
    """The soak's command: conftest.py starts it as soon as a test of this file is selected (EarlyProcess)."""
    return [sys.executable, str(REPO / "bench" / "iteration_soak.py"), "--size", "tiny", "--res", "64", "--steps", "2",
            "--cycles", "2", "--workdir", str(workdir), "--files-dir", str(workdir / "files"),
            "--out", str(workdir / "soak.json")]


@pytest.fixture(scope="module")
def soak(early_process):
    result = json.loads((early_process / "soak.json").read_text())
    return result, {row["label"]: row for row in result["rows"]}


def test_every_prompt_ends_as_it_should_and_comfyui_reports_no_leak(soak):
    result, rows = soak
    assert result["summary"]["failed"] == [] and result["summary"]["leak_warnings"] == 0
    assert rows["[1] stopped while compiling"]["status"] == rows["[1] stopped while calibrating"]["status"] \
        == "interrupted"
    assert all(row["status"] in ("success", "freed", "interrupted") for row in result["rows"])


def test_only_new_weights_or_settings_calibrate_and_lora_changes_compile_nothing(soak):
    _, rows = soak
    assert rows["Quantize + Compile, first"]["calibrations"] == 1
    for cycle in ("[1]", "[2]"):
        for change in UNCHANGED_STRUCTURE:
            row = rows[f"{cycle} {change}"]
            assert row["calibrations"] == 0 and row["graphs_compiled"] == 0, row
        assert rows[f"{cycle} LoRA 0.4 (strength change)"]["lora_strengths_written"] >= 1
        assert rows[f"{cycle} another LoRA file"]["lora_factors_written"] >= 1
    assert all(row["graphs_compiled"] == 0 and row["calibrations"] == 0
               for label, row in rows.items() if label.startswith("[2]"))
    assert rows["[1] the same, queued again"]["status"] == "success"


def test_the_second_cycle_holds_no_more_host_memory_than_the_first(soak):
    """Measured after each cycle's /free: the live CPU tensors, and the anonymous memory once glibc has returned its
    free pages (the plain figure wanders by the pages glibc keeps)."""
    result, _ = soak
    first, second = (result["summary"]["after_free_by_cycle_gib"][cycle] for cycle in ("[1]", "[2]"))
    assert second["held_tensors_gib"] <= first["held_tensors_gib"] + 0.02
    assert second["anon_trimmed_gib"] <= first["anon_trimmed_gib"] + 0.2


def test_a_restart_on_the_same_caches_calibrates_only_the_file_never_quantized(soak):
    _, rows = soak
    new, cached = rows["restart: a file never quantized (graphs cached)"], rows["restart: the first file (all cached)"]
    assert new["calibrations"] == 1 and new["graphs_compiled"] == 0
    assert cached["calibrations"] == 0 and cached["graphs_compiled"] == 0 and cached["status"] == "success"


def test_a_soak_cut_before_its_end_is_read_back_from_its_log():
    """A GPU call's time limit can cut a soak before it writes its result: its log's prompt lines give the rows back,
    each with what the log lines before it counted (compiles, calibrations, fallbacks) and, after /free, what stayed."""
    from overdrive.harness.iteration_soak import row_line, rows_from_log
    rows = [{"label": "Quantize + Compile, first", "status": "success", "seconds": 58.22, "sampling_seconds": 17.11,
             "anon_gib": 35.54, "file_gib": 22.78, "gpu_gib": 2.42, "graphs_compiled": 2, "calibrations": 1,
             "leak_warnings": 0},
            {"label": "[1] LoRA 0.8", "status": "error", "seconds": 1.5, "sampling_seconds": 0.0, "anon_gib": 2.2,
             "file_gib": 22.9, "gpu_gib": None, "graphs_compiled": 0, "calibrations": 0, "leak_warnings": 0},
            {"label": "[1] /free", "status": "freed", "seconds": None, "sampling_seconds": None, "anon_gib": 3.1,
             "file_gib": 0.4, "gpu_gib": 0.6, "graphs_compiled": 0, "calibrations": 0, "leak_warnings": 0,
             "held_tensors_gib": 0.031, "anon_trimmed_gib": 0.78}]
    log = "\n".join([
        "INFO:overdrive.compiler:Overdrive compiled DoubleStreamBlock (339.8M parameters).forward [a]: 1 graph(s) in 9 s",
        "INFO:overdrive.compiler:Overdrive compiled SingleStreamBlock (141.6M parameters).forward [b]: 1 graph(s) in 2 s",
        "INFO:overdrive:Overdrive quantization (fp8_e4m3 on cuda:0, calibrated): [cache miss, calibrated with ...]",
        row_line(rows[0]),
        "WARNING:overdrive:Overdrive: quantizing failed, so the model runs unquantized (your generation continues).",
        row_line(rows[1]), row_line(rows[2])])
    read = rows_from_log(log)
    assert [row["label"] for row in read] == [row["label"] for row in rows]
    assert read[0]["seconds"] == 58.22 and read[0]["sampling_seconds"] == 17.11 and read[1]["gpu_gib"] is None
    assert (read[0]["graphs_compiled"], read[0]["calibrations"], read[0]["fallbacks"]) == (2, 1, 0)
    assert (read[1]["status"], read[1]["graphs_compiled"], read[1]["fallbacks"]) == ("error", 0, 1)
    assert (read[2]["held_tensors_gib"], read[2]["anon_trimmed_gib"]) == (0.031, 0.78)
    assert "held_tensors_gib" not in read[1]

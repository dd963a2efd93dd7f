"""The fault soak, short: a real ComfyUI server driven over its HTTP API with stops at random points, corrupted and
deleted cache files, damaged and wrong checkpoints, an invalid setting, prompts queued together and a restart
(harness/soak.py; the full run is `python -m overdrive.harness.soak --prompts 200 --families --workdir DIR`)."""
import json
import sys

# Three variants that hold every node and what the faults act on (compiled caches, quantized layers, the step cache,
# switched weights; Compile Model alone is in two of them); the full soak runs all eight, each a compile of its own
# on a CPU.
VARIANTS = ("eager", "quantize-compile-deepcache", "switch-weights")
PROMPTS = 11  # 3 references (one seed), then each kind of fault once (8 prompts), the restart halfway


def start_early(workdir):
    """The soak's command: conftest.py starts it as soon as this file's test is selected (EarlyProcess); its server
    does the work while this process waits on HTTP."""
    return [sys.executable, "-m", "overdrive.harness.soak", "--prompts", str(PROMPTS), "--seed", "1", "--seeds", "1",
            "--only", ",".join(VARIANTS), "--workdir", str(workdir / "soak"), "--out", str(workdir / "soak.json")]


def test_a_short_fault_soak_ends_every_prompt_as_expected_with_the_images_of_prompts_run_alone(early_process):
    result = json.loads((early_process / "soak.json").read_text())
    assert result["failures"] == []
    assert result["leak_warnings"] == 0  # ComfyUI found a model it let go still alive
    assert result["prompts"] >= PROMPTS and result.get("lost", 0) == 0 and result["restarts"] == 1
    assert result["success"] > result["prompts"] // 2  # most prompts are clean ones: the soak did real work

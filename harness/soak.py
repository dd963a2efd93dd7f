"""A fault soak: a real ComfyUI server with Overdrive, driven over its HTTP API on loopback with Overdrive's workflows
while faults are thrown at it: stops at random points (compiling, calibrating, sampling), corrupted and deleted cache
files, damaged and wrong checkpoints, an invalid setting, prompts queued together, a restart in the middle.

It checks what users rely on: the server never goes down; every queued prompt ends, as a success, a clear error or
interrupted, matching what was done to it; and every image equals the image of the same prompt run alone.

    python -m overdrive.harness.soak --prompts 200 --workdir /tmp/soak      (the full run; counts as JSON on stdout)
"""
import argparse
import copy
import json
import pathlib
import random
import sys
import time

from .client import ComfyClient, PromptFailed
from .server import start_with_models
from .workflows import load_workflow, set_inputs, set_latent_size, without_overdrive

RES, STEPS = 64, 2  # CPU-sized
SEEDS = (1, 2)  # each variant at each seed is one prompt, run alone first for its reference image
SWITCH_TARGET = "overdrive-builtin-sd15-seed1.safetensors"


def variants(families: bool) -> dict:
    """{name: API workflow} at RES and STEPS: every node alone and combined (and, with `families`, a DiT family)."""
    def small(name):
        return set_inputs(set_latent_size(load_workflow(name), RES, RES, frames=5), "KSampler", steps=STEPS)
    found = {
        "eager": without_overdrive(small("compile_model_sd15_api.json")),
        "compile": small("compile_model_sd15_api.json"),
        "compile-static": set_inputs(small("compile_model_sd15_api.json"), "OverdriveCompileModel",
                                     dynamic="static", regional=False, cuda_graphs=False),
        "quantize-compile": small("compile_quantize_sd15_api.json"),
        "deepcache-compile": small("compile_deepcache_sd15_api.json"),
        "quantize-compile-deepcache": small("compile_quantize_deepcache_sd15_api.json"),
        "switch-weights": small("switch_weights_sd15_api.json"),
        "compile-vae": small("compile_vae_sd15_api.json"),
    }
    for workflow in found.values():  # QuantizeModel at this size: density would refuse every layer
        for node in workflow.values():
            if node["class_type"] == "OverdriveQuantizeModel":
                node["inputs"].update(compute_density_threshold=0.0, calibration_steps=1)
    if families:
        found["wan22-compile"] = small("compile_wan22_api.json")
    return found


def with_seed(workflow: dict, seed: int) -> dict:
    return set_inputs(copy.deepcopy(workflow), "KSampler", seed=seed)


class Soak:
    def __init__(self, workdir, prompts: int, seed: int = 0, families: bool = False, log=print, seeds=SEEDS,
                 only: tuple | None = None):
        """`only`: the variants whose prompts run (references and random faults; default all). The faults that
        need a workflow of their own (a damaged checkpoint, an invalid setting) use theirs either way."""
        self.workdir = pathlib.Path(workdir)
        self.prompts, self.rng, self.log, self.seeds = prompts, random.Random(seed), log, tuple(seeds)
        self.variants = variants(families)
        self.running = sorted(only or self.variants)
        self.references: dict = {}  # (variant, seed) -> pixels of the prompt run alone
        self.entries: dict = {}  # prompt id -> its history entry
        self.counts: dict = {}
        self.failures: list = []
        self.server = self.client = None

    # ------------------------------------------------------------------------------------------------ the server
    def files(self) -> tuple[dict, dict]:
        from ..builtin_models import ensure_checkpoint
        from .workflows import builtin_dit_files
        checkpoints = {"overdrive-builtin-sd15.safetensors": ensure_checkpoint("sd15", "tiny", seed=0),
                       SWITCH_TARGET: ensure_checkpoint("sd15", "tiny", seed=1)}
        bad = self.workdir / "bad"
        bad.mkdir(parents=True, exist_ok=True)
        data = pathlib.Path(checkpoints[SWITCH_TARGET]).read_bytes()
        (bad / "truncated.safetensors").write_bytes(data[: len(data) // 2])
        (bad / "garbage.safetensors").write_bytes(bytes(self.rng.randrange(256) for _ in range(4096)))
        from safetensors.torch import save_file
        import torch
        save_file({"first_stage_model.decoder.conv_in.weight": torch.zeros(4, 4)}, str(bad / "wrong-model.safetensors"))
        checkpoints.update({p.name: p for p in bad.iterdir()})
        return checkpoints, (builtin_dit_files(("wan22",)) if "wan22-compile" in self.variants else {})

    def start(self, checkpoints, other_files):
        self.server = start_with_models(self.workdir, checkpoints, other_files,
                                        env={"OVERDRIVE_CACHE_DIR": str(self.cache_dir)})
        self.client = ComfyClient(self.server.url)

    @property
    def cache_dir(self) -> pathlib.Path:
        return self.workdir / "overdrive-cache"

    def alive(self) -> bool:
        try:
            self.client.get("/system_stats")
            return self.server.process.poll() is None
        except OSError:
            return False

    # ------------------------------------------------------------------------------------------------ prompts
    def outcome(self, prompt_id: str) -> tuple[str, str]:
        """('success' | 'interrupted' | 'error' | 'lost', error message) once the prompt has ended."""
        try:
            entry = self.entries[prompt_id] = self.client.finished(prompt_id)
        except TimeoutError as error:
            return "lost", str(error)
        status = entry.get("status", {})
        events = {name: data for name, data in status.get("messages", [])}
        if status.get("status_str") == "success":
            return "success", ""
        if "execution_interrupted" in events:
            return "interrupted", ""
        return "error", str(events.get("execution_error", {}).get("exception_message", ""))

    def pixels(self, prompt_id: str) -> list:
        import numpy as np
        from PIL import Image
        files = ComfyClient.output_files(self.entries[prompt_id], self.server.output_dir)
        return [np.asarray(Image.open(path)) for path in sorted(files)]

    def check(self, what: str, key, prompt_id: str, allowed: set, message: str = "") -> str:
        result, error = self.outcome(prompt_id)
        self.counts[result] = self.counts.get(result, 0) + 1
        self.counts["prompts"] = self.counts.get("prompts", 0) + 1
        if result not in allowed:
            self.failures.append(f"{what} {key}: ended {result} ({error[:300]}), expected one of {sorted(allowed)}")
        elif result == "error" and message not in error:
            self.failures.append(f"{what} {key}: unclear error {error[:300]!r}, expected it to say {message!r}")
        elif result == "success" and key is not None:
            images = self.pixels(prompt_id)
            reference = self.references.setdefault(key, images) if what == "alone" else self.references.get(key)
            if reference is None:
                self.failures.append(f"{what} {key}: no image of this prompt run alone to compare with")
            elif len(images) != len(reference) or any((a != b).any() for a, b in zip(images, reference)):
                self.failures.append(f"{what} {key}: image differs from the same prompt run alone")
                self.counts["differing_images"] = self.counts.get("differing_images", 0) + 1
        if not self.alive():
            self.failures.append(f"{what} {key}: the server went down")
            raise RuntimeError("the server went down: " + self.server.log_tail())
        return result

    def queue(self, key) -> str:
        variant, seed = key
        return self.client.queue(with_seed(self.variants[variant], seed))

    def random_key(self):
        return self.rng.choice(self.running), self.rng.choice(self.seeds)

    # ------------------------------------------------------------------------------------------------ faults
    def clean(self):
        key = self.random_key()
        self.check("clean", key, self.queue(key), {"success"})

    def interrupt(self):
        key = self.random_key()
        prompt_id = self.queue(key)
        time.sleep(self.rng.uniform(0.0, 4.0))  # anywhere: loading, calibrating, compiling, sampling, decoding
        self.client.post("/interrupt", {})
        self.check("interrupt", key, prompt_id, {"success", "interrupted"})

    def corrupt_cache(self):
        files = sorted(p for p in self.cache_dir.rglob("*") if p.is_file() and "checkpoints" not in p.parts)
        for path in self.rng.sample(files, min(3, len(files))):
            action = self.rng.choice(("truncate", "garbage", "delete"))
            if action == "delete":
                path.unlink()
            else:
                data = path.read_bytes()
                path.write_bytes(data[: len(data) // 2] if action == "truncate" else b"\0garbage" * 64)
        self.clean()

    def damaged_checkpoint(self):
        name = self.rng.choice(("truncated.safetensors", "garbage.safetensors"))
        workflow = set_inputs(with_seed(self.variants["switch-weights"], 1), "OverdriveSwitchWeights", ckpt_name=name)
        self.check("damaged checkpoint", None, self.client.queue(workflow), {"error"}, "could not be read")

    def wrong_checkpoint(self):
        workflow = set_inputs(with_seed(self.variants["switch-weights"], 1), "OverdriveSwitchWeights",
                              ckpt_name="wrong-model.safetensors")
        self.check("wrong checkpoint", None, self.client.queue(workflow), {"error"}, "no weights for this model")

    def invalid_setting(self):
        workflow = set_inputs(with_seed(self.variants["quantize-compile"], 1), "OverdriveQuantizeModel",
                              linear_mse_threshold=-1.0)
        try:
            self.client.queue(workflow)
        except PromptFailed as error:  # ComfyUI's validation, from the input's declared minimum
            self.counts["rejected"] = self.counts.get("rejected", 0) + 1
            if "linear_mse_threshold" not in str(error):
                self.failures.append(f"invalid setting: rejected without naming it: {str(error)[:300]}")
            return
        self.failures.append("invalid setting: a negative threshold was accepted")

    def together(self):
        keys = [self.random_key() for _ in range(3)]
        ids = [self.queue(key) for key in keys]
        for key, prompt_id in zip(keys, ids):
            self.check("queued together", key, prompt_id, {"success"})

    def restart(self, checkpoints, other_files):
        self.server.stop()
        self.counts["restarts"] = self.counts.get("restarts", 0) + 1
        self.start(checkpoints, other_files)

    # ------------------------------------------------------------------------------------------------ the run
    def run(self) -> dict:
        checkpoints, other_files = self.files()
        self.start(checkpoints, other_files)
        started = time.monotonic()
        try:
            for key in [(variant, seed) for variant in self.running for seed in self.seeds]:
                self.check("alone", key, self.queue(key), {"success"})  # the references, and the compiles
            faults = [(self.clean, 5), (self.interrupt, 3), (self.corrupt_cache, 1), (self.damaged_checkpoint, 1),
                      (self.wrong_checkpoint, 1), (self.invalid_setting, 1), (self.together, 1)]
            restart_at = self.prompts // 2
            first = [f for f, _ in faults]  # every kind once, then drawn by weight
            while self.counts.get("prompts", 0) < self.prompts:
                if restart_at is not None and self.counts["prompts"] >= restart_at:
                    self.restart(checkpoints, other_files)
                    restart_at = None
                fault = first.pop(0) if first else self.rng.choices([f for f, _ in faults], [w for _, w in faults])[0]
                fault()
                self.log(f"{self.counts.get('prompts', 0)} prompts, {len(self.failures)} failures "
                         f"({time.monotonic() - started:.0f} s)")
        finally:
            self.server.stop()
        # ComfyUI's "memory leak with model ...": a model it let go that something still holds (both servers' log)
        self.counts["leak_warnings"] = sum("memory leak" in line for line in self.server.log_text().splitlines())
        return dict(self.counts, failures=self.failures, seconds=round(time.monotonic() - started, 1),
                    variants=self.running)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", required=True, help="an empty folder for the server's files and caches")
    parser.add_argument("--families", action="store_true", help="also a DiT family (Wan 2.2, tiny)")
    parser.add_argument("--seeds", type=lambda text: tuple(int(seed) for seed in text.split(",")), default=SEEDS,
                        help="the KSampler seeds of the reference prompts, comma-separated")
    parser.add_argument("--only", type=lambda text: tuple(text.split(",")),
                        help="the variants whose prompts run, comma-separated (default: all)")
    parser.add_argument("--out", help="also write the counts to this JSON file")
    args = parser.parse_args()
    result = Soak(args.workdir, args.prompts, args.seed, args.families, seeds=args.seeds, only=args.only,
                  log=lambda line: print(line, flush=True, file=sys.stderr)).run()
    print(json.dumps(result, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result))
    raise SystemExit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()

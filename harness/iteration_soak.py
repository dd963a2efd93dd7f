"""The iteration loop as a ComfyUI user runs it: one long-lived ComfyUI (its own prompt executor and output cache,
harness/executor.py), prompts that change a LoRA's strength, the LoRA, the prompt, the size and the model, eager
prompts between, stops during a compile and a calibration, /free.

Per prompt: how it ended, its time (ComfyUI's own execution_start to end timestamps), the process's host memory (its
anonymous and file-backed resident memory), the GPU memory in use (dynamic VRAM keeps weights outside torch's
allocator: the device's own figure), what the log says it compiled, calibrated or reused, and ComfyUI's "memory leak
with model" warnings. bench/iteration_soak.py runs it on the GPU at Flux.1's size; tests/test_iteration_soak.py on the
CPU with the tiny model.
"""
import copy
import dataclasses
import itertools
import json
import re

LEAK = "memory leak with model"
COMPILED = re.compile(r"Overdrive compiled .*?: (\d+) graph")
COUNTED = {"calibrations": "cache miss, calibrated", "quantize_reused": "quantized earlier in this process",
           "lora_strengths_written": "LoRA strengths written", "lora_factors_written": "LoRA factors written",
           "graphs_recorded_again": "is recorded again: its weights moved",
           "fallbacks": "your generation continues"}  # an optimization that failed and was left out, with a warning


@dataclasses.dataclass(frozen=True)
class Files:
    """ComfyUI file names: two diffusion models of one architecture, their VAE, two LoRAs of the first."""
    model: str
    other: str
    vae: str
    loras: tuple


@dataclasses.dataclass
class Step:
    label: str
    prompt: dict | None  # None: POST /free (unload models and free memory), as the UI's button does
    stop_in: str | None = None  # the class of the node during whose run the prompt is stopped
    stop_after: float = 0.0  # seconds into that node


def node_defaults(object_info: dict, class_type: str) -> dict:
    """{input: default} of a node's widget inputs, from the server's /object_info."""
    spec = object_info[class_type]["input"]
    return {name: options[1]["default"] for section in ("required", "optional")
            for name, options in spec.get(section, {}).items()
            if len(options) > 1 and isinstance(options[1], dict) and "default" in options[1]}


def flux_prompt(info: dict, files: Files, *, loras=(), quantize=None, compile_options=None, step_cache=False,
                switch=None, size=1024, steps=20, seed=1, prompt_seed=0, prefix="soak", model=None) -> dict:
    """An API prompt: Load Diffusion Model -> LoRAs (model only) -> [Quantize Model] -> [Compile Model] -> [step cache]
    -> [Switch Diffusion Model] -> KSampler on Built-in Conditioning -> VAE Decode -> Save Image. `quantize` and
    `compile_options`: the nodes' inputs over their defaults ({} for the defaults; None: no node). `model`: the file
    Load Diffusion Model reads (default: the first)."""
    prompt, last = {"unet": {"class_type": "UNETLoader", "inputs": {"unet_name": model or files.model,
                                                                   "weight_dtype": "default"}}}, ["unet", 0]

    def add(node_id, class_type, **inputs):
        nonlocal last
        prompt[node_id] = {"class_type": class_type,
                           "inputs": {**node_defaults(info, class_type), "model": last, **inputs}}
        last = [node_id, 0]

    for index, (name, strength) in enumerate(loras):
        add(f"lora{index}", "LoraLoaderModelOnly", lora_name=name, strength_model=strength)
    if quantize is not None:  # calibrated on the prompt's conditioning and latent, as a user wires it
        add("quantize", "OverdriveQuantizeModel", positive=["cond", 0], negative=["cond", 1], latent=["latent", 0],
            **quantize)
    if compile_options is not None:
        add("compile", "OverdriveCompileModel", **compile_options)
    if step_cache:
        add("step_cache", "OverdriveDeepCache")
    if switch is not None:
        add("switch", "OverdriveSwitchDiffusionModel", unet_name=switch)
    prompt.update({
        "cond": {"class_type": "OverdriveBuiltinConditioning",
                 "inputs": {**node_defaults(info, "OverdriveBuiltinConditioning"), "family": "flux",
                            "seed": prompt_seed}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "sampler": {"class_type": "KSampler", "inputs": {
            "model": last, "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["cond", 0], "negative": ["cond", 1], "latent_image": ["latent", 0], "denoise": 1.0}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": files.vae}},
        "decode": {"class_type": "VAEDecode", "inputs": {"samples": ["sampler", 0], "vae": ["vae", 0]}},
        "save": {"class_type": "SaveImage", "inputs": {"images": ["decode", 0], "filename_prefix": prefix}},
    })
    return prompt


def plan(info: dict, files: Files, size: int, steps: int, cycles: int = 2, stops: bool = True,
         core: bool = False) -> list:
    """The soak's steps: eager on each file, Quantize + Compile, + step cache, then `cycles` cycles of LoRA strength
    and file changes, two LoRAs, none, a prompt change, a size change and back, eager prompts on each file, Switch
    Diffusion Model to the second file and back, Compile Model alone; the first cycle also stops a compile and a
    calibration (each queued again after); each cycle ends with /free and a prompt after it. `core`: without the size
    change, Compile Model alone, the stops and /free (the steps that compile, calibrate or load anew), for a model too
    large to run them all in a GPU call."""
    seeds = iter(range(1, 10_000))
    one, two = files.loras[:2]
    fast = dict(quantize={}, compile_options={}, step_cache=True)

    def prompt(label, **settings):
        settings = {"size": size, "steps": steps, "seed": next(seeds), "prefix": f"soak-{label}", **settings}
        return flux_prompt(info, files, **settings)

    # eager's own host memory with both files loaded, before any Overdrive node: the bound of the rows that hold both
    steps_list = [Step("eager", prompt("eager")), Step("eager, next seed", prompt("eager-2")),
                  Step("eager, the second file", prompt("eager-other", model=files.other)),
                  Step("Quantize + Compile, first", prompt("qc", quantize={}, compile_options={})),
                  Step("Quantize + Compile, next seed", prompt("qc-2", quantize={}, compile_options={})),
                  Step("+ step cache", prompt("qcs", **fast)),
                  Step("+ step cache, next seed", prompt("qcs-2", **fast))]
    for cycle in range(1, cycles + 1):
        c = f"[{cycle}] "
        steps_list += [
            Step(c + "eager + LoRA 0.8", prompt("e-lora", loras=[(one, 0.8)])),
            Step(c + "eager + LoRA 0.4 (strength change)", prompt("e-lora-2", loras=[(one, 0.4)])),
            Step(c + "LoRA 0.8", prompt("lora", loras=[(one, 0.8)], **fast)),
            Step(c + "LoRA 0.8, next seed", prompt("lora-2", loras=[(one, 0.8)], **fast)),
            Step(c + "LoRA 0.4 (strength change)", prompt("lora-3", loras=[(one, 0.4)], **fast)),
            Step(c + "LoRA 0.4, next seed", prompt("lora-4", loras=[(one, 0.4)], **fast)),
            Step(c + "another LoRA file", prompt("lora-5", loras=[(two, 0.8)], **fast)),
            Step(c + "two LoRAs", prompt("lora-6", loras=[(one, 0.6), (two, 0.5)], **fast)),
            Step(c + "LoRA removed", prompt("nolora", **fast)),
            Step(c + "prompt changed", prompt("prompt", prompt_seed=cycle, **fast)),
        ]
        if not core:
            steps_list += [Step(c + "size 3/4", prompt("small", **{**fast, "size": size * 3 // 4 // 16 * 16})),
                           Step(c + "size back", prompt("big", **fast))]
        steps_list += [
            Step(c + "eager between", prompt("e-between")),
            Step(c + "eager on the second file", prompt("e-other", model=files.other)),  # what eager holds of two
            Step(c + "Switch Diffusion Model to the second file", prompt("switch", switch=files.other, **fast)),
            Step(c + "back to the first file", prompt("back", **fast)),
        ]
        if not core:
            steps_list.append(Step(c + "Compile Model alone", prompt("c", compile_options={})))
        if stops and not core and cycle == 1:
            recompile = dict(fast, compile_options={"dynamic": "dynamic"})  # other options: a compile of its own
            recalibrate = dict(fast, quantize={"linear_mse_threshold": 0.011})  # other settings: calibrated anew
            steps_list += [
                Step(c + "stopped while compiling", prompt("stop-c", **recompile), "KSampler", 1.0),
                Step(c + "the same, queued again", prompt("stop-c-2", **recompile)),
                Step(c + "stopped while calibrating", prompt("stop-q", **recalibrate), "OverdriveQuantizeModel", 1.0),
                Step(c + "the same, queued again", prompt("stop-q-2", **recalibrate)),
            ]
        if stops and not core:  # ComfyUI lets go of every model: what stays is Overdrive's own, cycle after cycle
            steps_list += [Step(c + "/free", None),
                           Step(c + "after /free", prompt("free", loras=[(one, 0.8)], **fast))]
    return steps_list


def restart_plan(info: dict, files: Files, size: int, steps: int) -> list:
    """After a restart with the same caches: Quantize + Compile + step cache on the first file first (everything cached:
    the prompt a user queues again after a restart), then on the second file (its decisions are not cached:
    calibrated; its graphs are)."""
    fast = dict(quantize={}, compile_options={}, step_cache=True, size=size, steps=steps)
    return [Step("restart: the first file (all cached)",
                 flux_prompt(info, files, **fast, seed=2, prefix="soak-restart-cached")),
            Step("restart: a file never quantized (graphs cached)",
                 flux_prompt(info, files, **fast, seed=1, prefix="soak-restart-new", model=files.other))]


def process_memory() -> dict:
    """GiB of this process's anonymous and file-backed resident memory (/proc/self/status)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile"):
                fields[name] = int(value.split()[0]) / 2**20
    return {"anon_gib": round(fields.get("RssAnon", 0.0), 2), "file_gib": round(fields.get("RssFile", 0.0), 2)}


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage that Python objects still reach (each storage once). Unlike the process RSS, which
    the allocator keeps high after frees (+-300 MB between identical runs), this sees exactly what stays alive: old
    weights, twin modules, cached copies."""
    import gc

    import torch
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # fake/functional tensors left by compiles hold no memory
                continue
    return sum(storages.values())


def held_after_free() -> dict:
    """What the process still holds after /free: GiB of its live tensors, and its anonymous memory once glibc has
    returned the free pages it keeps (malloc_trim). The plain figure also counts those pages, which glibc keeps or
    returns as the heap happens to lie (0.4 GiB apart between cycles of the tiny soak), so it cannot tell a leak."""
    import ctypes
    held = live_tensor_bytes()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the figure stays untrimmed
        pass
    return {"held_tensors_gib": round(held / 2**30, 3), "anon_trimmed_gib": process_memory()["anon_gib"]}


def gpu_used_gib() -> float | None:
    """GiB in use on the GPU as its driver counts it (comfy-aimdo's buffers and every process included)."""
    import torch
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


class Soak:
    """Runs Steps through an InProcessComfy (harness/executor.py), one at a time, and records a row per step."""

    def __init__(self, comfy, log=print):
        self.comfy, self.log = comfy, log
        self.log_seen = len(comfy.log.lines)
        self.rows = []

    def run(self, steps) -> list:
        for step in steps:
            self.rows.append(self.step(step))
            self.log(row_line(self.rows[-1]))
            if self.rows[-1]["node_seconds"]:  # where a prompt's time went, node by node
                self.log("    nodes: " + ", ".join(f"{kind} {seconds:.2f}"
                                                   for kind, seconds in self.rows[-1]["node_seconds"].items()))
        return self.rows

    def step(self, step: Step) -> dict:
        if step.prompt is None:
            self.comfy.free()
            status, seconds, nodes = "freed", None, {}
        else:
            status, seconds, nodes = self.comfy.run(copy.deepcopy(step.prompt), step.stop_in, step.stop_after)
        row = {"label": step.label, "status": status, "seconds": seconds,
               "sampling_seconds": nodes.get("KSampler"), "decode_seconds": nodes.get("VAEDecode"),
               "node_seconds": nodes, **process_memory(), "gpu_gib": gpu_used_gib(), **self.new_log_counts()}
        if status == "freed":  # after the plain figure, which it changes
            row.update(held_after_free())
        return row

    def new_log_counts(self) -> dict:
        new = "\n".join(self.comfy.log.lines[self.log_seen:])
        self.log_seen = len(self.comfy.log.lines)
        return log_counts(new)


def log_counts(text: str) -> dict:
    """What a prompt's log lines say it compiled, calibrated, reused, fell back from and leaked."""
    return {"graphs_compiled": sum(int(n) for n in COMPILED.findall(text)),
            **{name: text.count(pattern) for name, pattern in COUNTED.items()}, "leak_warnings": text.count(LEAK)}


def row_line(row: dict) -> str:
    """The line the soak prints for a prompt (rows_from_log reads it back)."""
    return (f"{row['label']:<55} {row['status']:<12} {row['seconds'] or 0:7.2f} s (sampling "
            f"{row['sampling_seconds'] or 0:6.2f} s)  anon {row['anon_gib']:6.2f}  file {row['file_gib']:6.2f}  "
            f"gpu {row['gpu_gib']}  compiles {row['graphs_compiled']} calib {row['calibrations']} "
            f"leaks {row['leak_warnings']}" + (f"  held {row['held_tensors_gib']} trimmed {row['anon_trimmed_gib']}"
                                               if "held_tensors_gib" in row else ""))


ROW_LINE = re.compile(r"^(?P<label>\S.*?)\s+(?P<status>success|error|interrupted|invalid|freed|unknown)\s+"
                      r"(?P<seconds>[\d.]+) s \(sampling\s+(?P<sampling>[\d.]+) s\)\s+anon\s+(?P<anon>[\d.]+)\s+"
                      r"file\s+(?P<file>[\d.]+)\s+gpu (?P<gpu>\S+)\s+compiles (?P<compiled>\d+) "
                      r"calib (?P<calib>\d+) leaks (?P<leaks>\d+)"
                      r"(?:\s+held (?P<held>[\d.]+) trimmed (?P<trimmed>[\d.]+))?$")  # after /free


def rows_from_log(text: str) -> list:
    """The rows of the prompt lines in a soak's log (a run that a GPU call's time limit cut before it wrote its
    result): the printed figures, and the counters of the log lines before each (its prompt's)."""
    rows, since = [], []
    for line in text.splitlines():
        if not (found := ROW_LINE.match(line.rstrip())):
            since.append(line)
        else:
            seconds, sampling = float(found["seconds"]), float(found["sampling"])
            rows.append({"label": found["label"], "status": found["status"],
                         "seconds": None if found["status"] in ("freed", "invalid") else seconds,
                         "sampling_seconds": sampling,
                         "anon_gib": float(found["anon"]), "file_gib": float(found["file"]),
                         "gpu_gib": None if found["gpu"] == "None" else float(found["gpu"]),
                         **log_counts("\n".join(since))})
            if found["held"] is not None:
                rows[-1].update(held_tensors_gib=float(found["held"]), anon_trimmed_gib=float(found["trimmed"]))
            since = []
    return rows


def summary(rows: list, quantized_gib: float | None) -> dict:
    """The figures the issue asks for: the largest anonymous memory against eager's largest (+ the quantized model's
    bytes + 4 GiB), the last cycle's against the first's (largest, and after /free), the failed prompts and leak
    warnings, and the time of each change against the same prompt with nothing changed."""
    def seconds(label):
        found = [row["seconds"] for row in rows if row["label"] == label and row["seconds"] is not None]
        return found[-1] if found else None

    # eager's own: the eager prompts before any other (later ones run beside the models kept)
    eager = max((row["anon_gib"] for row in itertools.takewhile(lambda row: "eager" in row["label"], rows)),
                default=0.0)
    cycles = sorted({row["label"][:3] for row in rows if row["label"].startswith("[")})
    last_anon = {cycle: max(row["anon_gib"] for row in rows if row["label"].startswith(cycle)) for cycle in cycles}
    # a cycle's largest figure also counts the free pages glibc keeps; after /free (held_after_free) a leak shows alone
    held = ("anon_gib", "anon_trimmed_gib", "held_tensors_gib")
    after_free = {row["label"][:3]: {name: row.get(name) for name in held} for row in rows if row["status"] == "freed"}
    ratios = {}
    for cycle in cycles:
        unchanged = seconds(f"{cycle} LoRA 0.8, next seed")
        for change in ("LoRA 0.4 (strength change)", "another LoRA file", "two LoRAs", "LoRA removed"):
            changed = seconds(f"{cycle} {change}")
            if unchanged and changed:
                ratios[f"{cycle} {change}"] = round(changed / unchanged, 2)
    return {
        "eager_anon_gib": eager, "max_anon_gib": max((row["anon_gib"] for row in rows), default=0.0),
        "bound_gib": None if quantized_gib is None else round(eager + quantized_gib + 4, 2),
        "anon_by_cycle_gib": last_anon, "after_free_by_cycle_gib": after_free,
        "failed": [row["label"] for row in rows if row["status"] not in ("success", "freed") and
                   not (row["status"] == "interrupted" and "stopped" in row["label"])],
        "leak_warnings": sum(row["leak_warnings"] for row in rows),
        "fallbacks": [row["label"] for row in rows if row.get("fallbacks")],
        "change_over_unchanged": ratios,
    }


def write(path, rows: list, meta: dict) -> None:
    with open(path, "w") as out:
        json.dump({**meta, "rows": rows}, out, indent=1)

"""How fast do a memory-mapped checkpoint's layers reach the card: `.to("cuda")` one at a time, or `core.weights_ahead` (two page-locked buffers, the next layer read while the card copies this one)? (answer: bench/experiments/quantize-model-time.md)

A safetensors file of Flux-sized block linears (bf16), written once and read once so the page cache holds it (as after
a first prompt), then opened as ComfyUI opens a checkpoint (memory-mapped) and copied to the card layer by layer each
way, alternating, three rounds; one JSON line with each way's GB/s.

  python3 bench/probes/weights_ahead_probe.py [--gib 8] [--file /tmp/weights_ahead.safetensors]
"""
import argparse
import json
import pathlib
import time

import torch

from overdrive.core.weights_ahead import on_device_ahead
from overdrive.harness.inprocess import import_comfy

SHAPES = ((9216, 3072), (3072, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360))  # Flux's linears


def write(path: pathlib.Path, gib: float) -> None:
    from safetensors.torch import save_file
    tensors, total, index = {}, 0, 0
    while total < gib * 2**30:
        out_features, in_features = SHAPES[index % len(SHAPES)]
        tensors[f"layer{index}.weight"] = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        tensors[f"layer{index}.bias"] = torch.randn(out_features, dtype=torch.bfloat16)
        total += out_features * (in_features + 1) * 2
        index += 1
    save_file(tensors, str(path))


def layers_of(state: dict) -> list:
    count = len(state) // 2
    return [(state[f"layer{i}.weight"], state[f"layer{i}.bias"]) for i in range(count)]


def plain(layers: list) -> float:
    started = time.perf_counter()
    for weight, bias in layers:
        on_device = (weight.to("cuda"), bias.to("cuda"))
        on_device[0].float().sum()  # the work a quantizer does on each (keeps the copies honest)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def ahead(layers: list) -> float:
    started = time.perf_counter()
    for weight, bias in on_device_ahead(layers, "cuda"):
        weight.float().sum()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--file", default="/tmp/weights_ahead.safetensors")
    args = parser.parse_args()
    comfy = import_comfy(cpu=False)
    path = pathlib.Path(args.file)
    if not path.is_file():
        write(path, args.gib)
    nbytes = path.stat().st_size
    path.read_bytes()  # into the page cache, as after a first prompt
    layers = layers_of(comfy.utils.load_torch_file(str(path)))  # memory-mapped, as ComfyUI loads a checkpoint
    for weight, _ in layers[:2]:  # CUDA's context, the allocator's first blocks
        weight.to("cuda")
    rounds = {"plain .to": [], "weights_ahead": []}
    for _ in range(3):
        rounds["plain .to"].append(plain(layers))
        rounds["weights_ahead"].append(ahead(layers))
    print(json.dumps({"probe": "weights_ahead", "gpu": torch.cuda.get_device_name(), "gib": round(nbytes / 2**30, 2),
                      "layers": len(layers), "torch_threads": torch.get_num_threads(),
                      "seconds": {way: [round(s, 3) for s in times] for way, times in rounds.items()},
                      "gb_per_s": {way: round(nbytes / 1e9 / min(times), 2) for way, times in rounds.items()}}))


if __name__ == "__main__":
    main()

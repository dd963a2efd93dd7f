"""Parallel Model's scaling on paper: from a model's measured one-GPU step (Compile Model, bench_compile.py's result
files) and its largest self-attention (the chooser's record of the call's shapes), the time of each split over P
GPUs, with its communication at a link's nominal bandwidth and none of it overlapped with compute:
- cfg: the conditional and unconditional passes apart; per step only the latents travel (P = 2, a batch of 2).
- sequence (Ulysses): every attention layer trades q, k, v and its output between tokens and heads, four
  all-to-alls; each GPU sends (P - 1) / P of its shard of each, after a fixed cost per all-to-all.
- both: two CFG groups of P / 2 GPUs, each splitting the tokens of one pass.
Compute is taken as dividing evenly (an upper bound: smaller GEMMs run less efficiently, and the embeddings and the
final layer run on every GPU)."""
from __future__ import annotations

# Nominal per-GPU bandwidth in one direction, bytes/s: NVLink 4 on an H200 SXM (18 links x 25 GB/s), and one
# 400 Gb/s InfiniBand NDR adapter per GPU between hosts of 8 GPUs; and an assumed fixed cost of one all-to-all
# within a host and across hosts (NCCL's small-message latency is tens of microseconds).
NVLINK, NETWORK, GPUS_PER_HOST = 450e9, 50e9, 8
LATENCY_HOST, LATENCY_NETWORK = 25e-6, 50e-6
SPLITS = (("cfg", 2), ("sequence", 2), ("sequence", 4), ("sequence", 8), ("both", 4), ("both", 8), ("both", 16))
BYTES = 2  # bf16 activations


def attention_layers(arch: str) -> int:
    from overdrive.builtin_models.dit import FAMILIES
    full = FAMILIES[arch].full
    return full.get("num_layers") or full["depth"] + full["depth_single_blocks"]


def self_attention(row: dict) -> tuple:
    """(batch, tokens, heads, head dim) of the largest self-attention the chooser measured."""
    shapes = [c["q"] for c in row.get("attention_choices") or () if c["q"][2] == c["k"][2]]
    batch, heads, tokens, dim = max(shapes, key=lambda q: q[2])
    return batch, tokens, heads, dim


def all_to_all_s(batch: int, tokens: int, width: int, gpus: int) -> float:
    """One all-to-all of a (batch, tokens, width) tensor split over `gpus`: the time of the slowest link."""
    shard = batch * tokens / gpus * width * BYTES
    on_host = min(gpus, GPUS_PER_HOST)
    seconds = LATENCY_HOST + shard * (on_host - 1) / gpus / NVLINK
    if gpus > GPUS_PER_HOST:
        seconds = max(seconds, LATENCY_NETWORK + shard * (gpus - on_host) / gpus / NETWORK)
    return seconds


def estimate(step_s: float, layers: int, batch: int, tokens: int, heads: int, dim: int, mode: str,
             gpus: int) -> dict | None:
    """{"step_s", "comm_s", "speedup", "efficiency"} of one split, or None where it does not apply."""
    group = gpus // 2 if mode == "both" else gpus
    if (mode != "sequence" and batch < 2) or (mode == "cfg" and gpus != 2) or (mode != "cfg" and heads % group):
        return None
    comm = 0.0 if mode == "cfg" else 4 * layers * all_to_all_s(batch // (gpus // group), tokens, heads * dim, group)
    step = step_s / gpus + comm
    return {"step_s": step, "comm_s": comm, "speedup": step_s / step, "efficiency": step_s / step / gpus}


def table(reports) -> str:
    header = ("model (one GPU: s/step; largest self-attention)", "split", "GPUs", "link", "communication ms/step",
              "speed-up", "efficiency", "`bench/results/`")
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for report in reports:
        settings = report["settings"]
        row = next(r for r in report["results"] if r["variant"] == "overdrive")
        step_s = row["s_per_image"] / settings["steps"]
        batch, tokens, heads, dim = self_attention(row)
        label = f"{settings['arch']} ({step_s:.3f}; {batch} × {tokens} tokens × {heads} heads)"
        for mode, gpus in SPLITS:
            e = estimate(step_s, attention_layers(settings["arch"]), batch, tokens, heads, dim, mode, gpus)
            if e is not None:
                link = "NVLink" if gpus <= GPUS_PER_HOST else f"{gpus // GPUS_PER_HOST} hosts, 400 Gb/s"
                lines.append(f"| {label} | {mode} | {gpus} | {link} | {e['comm_s'] * 1e3:.0f} | "
                             f"{e['speedup']:.2f}× | {e['efficiency']:.2f} | `{report['file']}` |")
    return "\n".join(lines)

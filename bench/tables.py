"""Markdown tables generated from bench/results/, for README.md and bench/README.md (figures are not typed by hand).

  python bench/tables.py budgets bench/results/*_budget-*gib_flux_1024{,_prefetch}.json
"""
import json
import pathlib
import sys

COLUMNS = {"overdrive": "Compile Model", "overdrive+fp8+attn": "+ Quantize Model fp8",
           "overdrive+int4mse0.03+attn": "+ Quantize Model 4-bit (threshold 0.03)",
           "overdrive+fp8+attn+deepcache4+window0.1-0.95": "+ fp8 + step cache"}


def cell(row, eager) -> str:
    if row is None:
        return "—"
    return f"{row['s_per_image']:.3f} ({eager['s_per_image'] / row['s_per_image']:.2f}×)"


def budgets(paths) -> str:
    """One row per emulated card: eager, Compile Model, + fp8, + 4 bits, + fp8 and step cache (seconds per image and the ratio to eager
    in the same process), eager again after them where run, the weights eager streams per model call and their cost per
    image over a 25 GB/s link."""
    reports = sorted((json.loads(pathlib.Path(p).read_text()) | {"file": pathlib.Path(p).name} for p in paths),
                     key=lambda r: -r["settings"]["budget_gib"])
    lines = ["| card | eager | " + " | ".join(COLUMNS.values()) + " | eager after them | eager streams per call | "
             "at 25 GB/s | `bench/results/` |", "|---" * (len(COLUMNS) + 6) + "|"]
    for report in reports:
        rows = report["results"]
        eager = rows[0]
        by_variant = {row["variant"]: row for row in rows}
        again = [row for row in rows[1:] if row["variant"] == "eager"]
        lines.append(" | ".join([
            f"| {report['settings']['budget_gib']:g} GiB", f"{eager['s_per_image']:.3f}",
            *(cell(by_variant.get(variant), eager) for variant in COLUMNS),
            f"{again[0]['s_per_image']:.3f}" if again else "—",
            f"{eager.get('streamed_gib_per_call', 0):.1f} GiB", f"+{eager.get('stream_s_per_image_at_25gb_s', 0):.1f} s",
            f"`{report['file']}` |"]))
    return "\n".join(lines)


if __name__ == "__main__":
    print({"budgets": budgets}[sys.argv[1]](sys.argv[2:]))

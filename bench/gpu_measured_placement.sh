#!/usr/bin/env bash
# The measured placement of quantized layers on the GPU (comfy_host/working_memory.py): its GPU test, Sparse Video
# Attention's compiled test, then 4-bit Flux at an 8 GiB card (Quantize Model's defaults) beside eager in one process.
# Usage on the GPU machine, from the repository root, with the carried files of bench/gpu_dynamic_vram.sh:
#   bash bench/gpu_measured_placement.sh OUT
set -uo pipefail
out="$1"
source bench/device_env.sh
for test in "test_a_quantized_model_that_streams_by_comfyuis_estimate_fits_once_a_run_is_measured[flux]" \
            "test_sparse_video_attention_compiled_replays_its_blocks_and_matches_its_uncompiled_calls[wan22]"; do
  timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider "tests/test_dynamic_vram_gpu.py::$test" \
    >> "$out/gpu_tests.log" 2>&1
  echo "$test rc $?"
done
# five timed runs: the first two place by ComfyUI's estimate (the second is measured), the third records the blocks
# whose layers no longer stream; the median is the runs after
VARIANTS=eager,overdrive+int4+attn BUDGET_GIB=8 TAG=_measured_reserve TAIL=25 BENCH_ARGS="--repeats 5" \
  timeout "${BENCH_TIMEOUT:-320}" bash bench/gpu_dynamic_vram.sh flux-on "$out"

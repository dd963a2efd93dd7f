#!/usr/bin/env bash
# The iteration soak (bench/iteration_soak.py) on the GPU machine, from the repository root, with ComfyUI's archive,
# whl, whl_kitchen.tar.xz, whl_av.tar.xz, whl_fa3.tar.xz and whl_cudnn.tar.xz carried (bench/device_carry.sh):
#   bash bench/gpu_iteration_soak.sh OUT SIZE BUDGET_GIB|whole on|off [CYCLES]
# Its result and log go to OUT, named after the card, ComfyUI, dynamic VRAM and the budget. Its model files (two of
# 22 GB at full size) and work folder are removed at the end, so that a bench after it in the same call has the disk;
# KEEP_SOAK_FILES=1 keeps them for another soak.
set -uo pipefail
out="$1"; size="$2"; budget="$3"; dynamic="$4"; cycles="${5:-2}"; day=$(date +%F)
source bench/device_env.sh
card="budget-${budget}gib"; [ "$budget" = whole ] && card="whole-card"
name="${day}_${gpu}_comfy033_dynamic-${dynamic}_${card}_flux_${size}_iteration_soak"
budget_arg=(--budget-gib "$budget"); [ "$budget" = whole ] && budget_arg=()
python3 bench/iteration_soak.py --size "$size" "${budget_arg[@]}" --dynamic-vram "$dynamic" --cycles "$cycles" ${SOAK_ARGS:-} \
  --workdir "/tmp/soak-$dynamic-$budget" --out "$out/$name.json" > "$out/$name.log" 2>&1
echo "$name rc $?"
[ "${KEEP_SOAK_FILES:-0}" = 1 ] || rm -rf "/tmp/soak-$dynamic-$budget" "${TMPDIR:-/tmp}/overdrive-soak-files"
grep -E "^(eager|Quantize|\+ step|\[|restart)|Traceback|Error" "$out/$name.log" | cut -c1-170 | tail -${TAIL:-50}

#!/usr/bin/env bash
# Issue 57's whole-model A/B for one family of gpu_dynamic_vram.sh, dynamic VRAM on: one process each for the
# attention chooser with FlashAttention-3 (TAG _fa3), without it (`no-fa3`, TAG _no_fa3), and ComfyUI's own attention
# as the peers (--use-sage-attention, --use-ck-attention; TAG _sage, _ck). Separate processes, so that none reuses
# another's traces or attention choices. Each row lists the chooser's per-shape measurements (`attention_choices`).
# Carry what gpu_dynamic_vram.sh needs plus whl_sage (bench/device_carry.sh).
#   bash bench/gpu_fa3_ab.sh PART "$OUT"     PART: a gpu_dynamic_vram.sh family, e.g. flux | qwen | ltx2 | wan22_14b
#   PEERS="sage ck" (default) picks the peers; BENCH_ARGS (e.g. "--steps 10") applies to every process
set -uo pipefail
part="$1"; out="${2:-bench/results}"
ab() {  # tag, variants, then bench_compile.py arguments
  echo "== $part $1"
  TAG="$1" VARIANTS="$2" BENCH_ARGS="${BENCH_ARGS:-} ${*:3}" bash bench/gpu_dynamic_vram.sh "$part-on" "$out"
}
ab _fa3 "${FA3_VARIANTS:-eager,builtin,overdrive,overdrive+fp8+attn}"
ab _no_fa3 "${NO_FA3_VARIANTS:-eager,overdrive+no-fa3,overdrive+fp8+attn+no-fa3}"
for peer in ${PEERS-sage ck}; do
  ab "_$peer" "${PEER_VARIANTS:-eager,builtin}" --comfy-attention "$peer"
done

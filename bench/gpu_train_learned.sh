#!/usr/bin/env bash
# Trains the reference models with learned weights (builtin_models/training.py) on the GPU machine, both at once (each
# process is bound by its kernel launches, not by the GPU): the video DiT on the shipped Wan 2.1 VAE, and the MMDiT with
# its TAESD3 from scratch. Files, curves and logs go to OUT; copy the .safetensors into builtin_models/learned/.
# Carry ComfyUI-0.33.0.tar.gz, whl, whl_kitchen.tar.xz (bench/device_carry.sh).
#   bash bench/gpu_train_learned.sh "$OUT"      WAN_ARGS, SD35_ARGS: more trainer arguments; LIMIT_S: each one's cap
set -uo pipefail
out="${1:-/tmp/learned}"; mkdir -p "$out"
source bench/device_env.sh
# half the cores each: two processes of 16 threads spin against each other (rendering the scenes took 60x longer)
export OMP_NUM_THREADS=$(( $(nproc) / 2 ))
train() {  # family, then trainer arguments
  local family="$1"; shift
  timeout "${LIMIT_S:-500}" python3 -m overdrive.builtin_models.training --family "$family" --out "$out" "$@" \
    > "$out/training_$family.log" 2>&1
  echo "$family rc $?"
}
train wan22_14b --vae-from builtin_models/learned/scenes_vae_wan21.safetensors --dit-steps 9000 --image-batch 64 \
  --clip-batch 16 --save-every 500 ${WAN_ARGS:-} &
train sd35 --vae-steps 2000 --dit-steps 8000 --image-batch 64 --save-every 500 ${SD35_ARGS:-} &  # --vae-from: its TAESD3
wait
grep -v "Warning\|warn(" "$out"/training_*.log | grep -E " [0-9]+/[0-9]+ " | awk 'NR % 10 == 0' | cut -c1-200
tail -n 3 "$out"/training_*.log
ls -la "$out"

#!/usr/bin/env bash
# GPU runs per model family on ComfyUI 0.7.0: eager, ComfyUI's built-in TorchCompileModel, Overdrive CompileModel,
# + QuantizeModel fp8, side by side in one process per family (full-size configurations, random weights, bf16 for the
# DiTs and fp16 for the UNets, caches off so first runs include the whole compile).
# Usage on the GPU machine, from the repository root, with .devcarry/ComfyUI-0.7.0.tar.gz, whl and whl_av carried
# (bench/device_carry.sh makes them):
#   bash bench/gpu_dit_suite.sh PART "$OUT"      PART: flux | flux2 | chroma | wan22 | qwen_image | zimage | sd35 |
#                                                 ltxv | ltx2 | sdxl | sd15
#                                                 or restart-FAMILY (bench_restart_switch.py: cold and warm first image)
#                                                 or diffusers-flux (bench_diffusers_flux.py: overdrive.api against
#                                                 diffusers' recipes; carry .devcarry/whl_diffusers instead)
set -uo pipefail
part="$1"; out="${2:-bench/results}"; day=$(date +%F)
source bench/device_env.sh
#   VARIANTS=... overrides the variants; BENCH_ARGS=... adds bench_compile.py arguments (e.g. --profile)
variants="${VARIANTS:-eager,builtin,overdrive,overdrive+fp8}"
run() {  # name, then bench_compile.py arguments
  local name="$1"; shift
  python3 bench/bench_compile.py "$@" ${BENCH_ARGS:-} --variants "$variants" --out "$out/${day}_${gpu}_${name}.json" \
    > "$out/${name}.log" 2>&1
  grep -v "^W1\|Warning\|warn(\|it/s\]\|^{" "$out/${name}.log" | cut -c1-400 | tail -${TAIL:-40}
}
case "$part" in
  flux) run flux_1024 --arch flux --res 1024 --steps 20 --repeats 2 ;;
  wan22) run wan22_480p --arch wan22 --res 480 --width 832 --frames 33 --steps 20 --repeats 2 ;;
  qwen_image) run qwen_image_1328 --arch qwen_image --res 1328 --steps 20 --repeats 1 ;;
  zimage) run zimage_1024 --arch zimage --res 1024 --steps 8 --repeats 2 ;;
  sd35) run sd35_1024 --arch sd35 --res 1024 --steps 20 --repeats 2 ;;
  ltxv) run ltxv_768x512_97f --arch ltxv --res 512 --width 768 --frames 97 --steps 20 --repeats 2 ;;
  ltx2) run ltx2_768x512_97f --arch ltx2 --res 512 --width 768 --frames 97 --steps 20 --repeats 1 ;;  # with audio
  chroma) run chroma_1024 --arch chroma --res 1024 --steps 26 --repeats 2 ;;
  flux2) run flux2_1024 --arch flux2 --res 1024 --steps 20 --repeats 1 ;;  # 64 GB in bf16: an H200's
  sdxl) run sdxl_1024 --arch sdxl --res 1024 --steps 20 --repeats 3 ;;
  sd15) run sd15_512 --arch sd15 --res 512 --steps 20 --repeats 5 ;;
  restart-*)  # RESTART_ARGS=... adds bench_restart_switch.py arguments (e.g. --steps 8 --precompile off)
    family="${part#restart-}"
    python3 bench/bench_restart_switch.py --arch "$family" --switches 0 ${RESTART_ARGS:-} \
      --out "$out/${day}_${gpu}_${family}_restart.json" > "$out/restart_${family}.log" 2>&1
    grep -v "^W1\|Warning\|warn(" "$out/restart_${family}.log" | cut -c1-600 | tail -${TAIL:-12} ;;
  diffusers-flux)  # VARIANTS=... picks bench_diffusers_flux.py's variants (default: all)
    python3 bench/bench_diffusers_flux.py ${VARIANTS:+--variants "$VARIANTS"} ${BENCH_ARGS:-} \
      --out "$out/${day}_${gpu}_diffusers_flux1024.json" > "$out/diffusers_flux.log" 2>&1
    grep -v "^W1\|Warning\|warn(\|float32: \[\]" "$out/diffusers_flux.log" | cut -c1-600 | tail -${TAIL:-24} ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac

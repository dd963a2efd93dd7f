#!/usr/bin/env bash
# ComfyUI 0.33 on the GPU: the dynamic-VRAM GPU tests, then eager / ComfyUI's TorchCompileModel / Compile Model /
# + fp8 / + step cache side by side in one process per family, with dynamic VRAM on (ComfyUI's default on NVIDIA) or
# off, the model loaded from a file through ComfyUI's loader.
# Usage on the GPU machine, from the repository root, with .devcarry/ComfyUI-0.33.0.tar.gz, whl, whl_kitchen.tar.xz,
# whl_av.tar.xz (ComfyUI's V3 API, which the nodes use, imports PyAV), whl_fa3.tar.xz and whl_cudnn.tar.xz (the attention
# chooser's FlashAttention-3 and cuDNN fp8 backends, as install.sh gives a Hopper machine) carried (bench/device_carry.sh):
#   bash bench/gpu_dynamic_vram.sh PART "$OUT"    PART: tests | flux-on | flux-off | sdxl-on | sdxl-off | wan22-on | wan22-off |
#     wan22_720p-on | wan22_720p-off (Wan 2.2 5B 1280x704x121) |
#     qwen-on | qwen-off (Qwen-Image 1328²) | ltx2-on | ltx2-off (LTX-2 768x512x97, with audio) | wan22_14b-on | wan22_14b-off (a Wan 2.2 A14B expert, 480p) |
#     wan22-fp8_scaled-on | flux2-fp8_mixed-on (-off): a file stored in that fp8 layout, whose eager is ComfyUI's own fp8
#     path (Flux.2 at a quarter of its blocks: its 32 B parameters take longer to write than a device call lasts)
# ComfyUI's own attention as the peer of Overdrive's chooser, for every variant of a run: BENCH_ARGS="--comfy-attention
# ck" (comfy-kitchen, carried with whl_kitchen) or "--comfy-attention sage" (carry whl_attention, which holds
# sageattention and cuDNN's frontend, instead of whl_cudnn); TAG=_sage names the result apart. Each result row lists
# the chooser's measurements on the model's own inputs (`attention_choices`).
set -uo pipefail
part="$1"; out="${2:-bench/results}"; day=$(date +%F)
source bench/device_env.sh
variants="${VARIANTS:-eager,builtin,overdrive,overdrive+fp8+attn,overdrive+fp8+attn+deepcache4+window0.1-0.95}"
run() {  # name, dynamic on|off, then bench_compile.py arguments; TAG: a suffix of the result's name
  local name="$1${TAG:-}" dynamic="$2"; shift 2
  local budget=${BUDGET_GIB:+_budget-${BUDGET_GIB}gib}  # BUDGET_GIB=16: a 16 GiB card emulated (--budget-gib)
  local log="$out/${day}_${gpu}_comfy033_${name}_${dynamic}${budget}.log"  # dated like its result: no run reuses it
  python3 bench/bench_compile.py "$@" --dynamic-vram "$dynamic" --variants "$variants" ${BENCH_ARGS:-} \
    ${BUDGET_GIB:+--budget-gib "$BUDGET_GIB"} --out "$out/${day}_${gpu}_comfy033_dynamic-${dynamic}${budget}_${name}.json" \
    > "$log" 2>&1
  grep -v "^W1\|Warning\|warn(\|it/s\]\|^{" "$log" | cut -c1-400 | tail -${TAIL:-30}
}
case "$part" in
  tests)  # one process per test: run together, a dynamic-VRAM patcher collected late (ModelPatcherDynamic.__del__ ->
    # comfy-aimdo's host buffer truncate) crashed the process at the next family's first call or at exit, while every
    # test passes alone
    for test in $(python3 -m pytest tests/test_dynamic_vram_gpu.py -q -p no:cacheprovider --collect-only ${TEST_ARGS:-} |
                  grep "::"); do
      python3 -m pytest "$test" -q -p no:cacheprovider >> "$out/tests.log" 2>&1; echo "$test rc $?"
    done ;;
  sdxl-on|sdxl-off) run sdxl_1024 "${part#sdxl-}" --arch sdxl --res 1024 --steps 20 --repeats 3 ;;
  flux-on|flux-off) run flux_1024 "${part#flux-}" --arch flux --res 1024 --steps 20 --repeats 2 ;;
  wan22-on|wan22-off) run wan22_480p "${part#wan22-}" --arch wan22 --res 480 --width 832 --frames 33 --steps 20 \
                        --repeats 2 ;;
  wan22_14b-on|wan22_14b-off) run wan22_14b_480p "${part#wan22_14b-}" --arch wan22_14b --res 480 --width 832 \
                                --frames 33 --steps 20 --repeats 2 ;;
  wan22_720p-on|wan22_720p-off)  # issue 57's end-to-end shape (Wan 2.2 5B, 1280x704, 121 frames; 10 steps to fit a call)
    run wan22_720p_121f "${part#wan22_720p-}" --arch wan22 --res 704 --width 1280 --frames 121 --steps 10 \
      --repeats 1 ;;
  ltx2-on|ltx2-off) run ltx2_768x512_97f "${part#ltx2-}" --arch ltx2 --res 512 --width 768 --frames 97 --steps 20 \
                      --repeats 1 ;;  # with audio
  qwen-on|qwen-off) run qwen_image_1328 "${part#qwen-}" --arch qwen_image --res 1328 --steps 20 --repeats 2 ;;
  wan22-fp8_scaled-on|wan22-fp8_scaled-off)
    run wan22_480p_fp8_scaled "${part##*-}" --arch wan22 --res 480 --width 832 --frames 33 --steps 20 --repeats 2 \
      --layout fp8_scaled ;;
  flux2-fp8_mixed-on|flux2-fp8_mixed-off)
    run flux2_quarter_1024_fp8_mixed "${part##*-}" --arch flux2 --size quarter --res 1024 --steps 20 --repeats 2 \
      --layout fp8_mixed ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac

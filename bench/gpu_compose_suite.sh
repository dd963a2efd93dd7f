#!/usr/bin/env bash
# GPU calls for QuantizeModel and DeepCache, composed with CompileModel, against eager (same process, same seed).
# Usage on the GPU machine, from the repository root: bash bench/gpu_compose_suite.sh PART "$OUT"
#   PART: quant-sdxl | deepcache-sdxl | sdxl-all | sd15 | regional | issue6 | issue5-6 | diffusers | diffusers-restart |
#         issue5-6b | issue6-sdxl | issue6-sd15 | diffusers-flat | fp8-deepcache-profile | sd15-precompile | restart | restart-precompile | quant-vram | gemm | gemm-fp8 | gemm-autotune | diffusers-autotune | levers | memory | gpu-tests
set -uo pipefail
part="$1"; out="${2:-bench/results}"; day=$(date +%F)
cd bench
filter() { grep -v "^W1\|Warning\|warn(" | tail -"$1"; }
case "$part" in
  quant-sdxl)
    python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --variants eager,overdrive,overdrive+int8,overdrive+fp8 \
      --out "$out/${day}_h100_sdxl_quantize.json" 2>&1 | filter 14 ;;
  deepcache-sdxl)
    python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --repeats 2 \
      --variants eager,deepcache,overdrive,overdrive+deepcache \
      --out "$out/${day}_h100_sdxl_deepcache.json" > "$out/deepcache_sdxl.log" 2>&1; filter 12 < "$out/deepcache_sdxl.log" ;;
  sdxl-all)  # the most important variants first: a run stopped at its time limit still printed those
    python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --profile --profile-all \
      --variants eager,overdrive,overdrive+deepcache,peer,overdrive+int8 \
      --out "$out/${day}_h100_sdxl_all.json" > "$out/sdxl_all.log" 2>&1; filter 40 < "$out/sdxl_all.log" ;;
  sd15)
    python3 bench_compile.py --arch sd15 --res 512 --warm-cache --repeats 5 \
      --variants eager,peer,deepcache,overdrive,overdrive+deepcache --cprofile \
      --out "$out/${day}_h100_sd15_deepcache.json" > "$out/deepcache_sd15.log" 2>&1; filter 45 < "$out/deepcache_sd15.log" ;;
  regional)  # cold compile with regions vs one flat graph vs the peer (caches off), then where SD1.5's step time goes
    timeout 400 python3 bench_compile.py --arch sdxl --res 1024 --variants eager,overdrive,peer,overdrive-flat \
      --out "$out/${day}_h100_sdxl_regional.json" > "$out/sdxl_regional.log" 2>&1; filter 12 < "$out/sdxl_regional.log"
    timeout 170 python3 bench_compile.py --arch sd15 --res 512 --repeats 5 --profile --profile-all --cprofile \
      --variants eager,overdrive,overdrive+deepcache \
      --out "$out/${day}_h100_sd15_profile.json" > "$out/sd15_profile.log" 2>&1; filter 12 < "$out/sd15_profile.log" ;;
  issue6)  # DeepCache's one run per architecture: eager, DeepCache alone, compile (+ DeepCache, + int8 + DeepCache), peer
    variants=eager,deepcache,overdrive,overdrive+deepcache,overdrive+int8+deepcache,peer
    timeout 300 python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --variants $variants \
      --out "$out/${day}_h100_sdxl_deepcache_all.json" > "$out/sdxl_deepcache_all.log" 2>&1; filter 10 < "$out/sdxl_deepcache_all.log"
    timeout 270 python3 bench_compile.py --arch sd15 --res 512 --warm-cache --repeats 5 --variants $variants \
      --out "$out/${day}_h100_sd15_deepcache_all.json" > "$out/sd15_deepcache_all.log" 2>&1; filter 10 < "$out/sd15_deepcache_all.log" ;;
  issue5-6)  # issues 5 and 6 in one SDXL run: compile + fp8 (static activation scales) and DeepCache against eager/peer
    variants=eager,overdrive,overdrive+fp8,overdrive+fp8+deepcache,overdrive+deepcache,deepcache,peer
    timeout "${SDXL_TIMEOUT:-420}" python3 bench_compile.py --arch sdxl --res 1024 --warm-cache --variants $variants \
      --out "$out/${day}_h100_sdxl_issue5_6.json" > "$out/sdxl_issue5_6.log" 2>&1; filter 14 < "$out/sdxl_issue5_6.log" ;;
  issue5-6b)  # the rows the issue5-6 run could not fit, against eager and CompileModel again (another process)
    timeout "${SDXL_TIMEOUT:-420}" python3 bench_compile.py --arch sdxl --res 1024 --warm-cache \
      --variants eager,deepcache,overdrive,peer --out "$out/${day}_h100_sdxl_issue5_6b.json" > "$out/sdxl_issue5_6b.log" 2>&1
    filter 8 < "$out/sdxl_issue5_6b.log" ;;
  issue6-sdxl | issue6-sd15)  # issue 6's one run per architecture, quantization now fp8 (static scales); key rows first
    arch=${part#issue6-}; res=$([ "$arch" = sdxl ] && echo 1024 || echo 512)
    timeout "${ISSUE6_TIMEOUT:-540}" python3 bench_compile.py --arch "$arch" --res "$res" --warm-cache --repeats 3 \
      --variants eager,overdrive,overdrive+deepcache,deepcache,peer,overdrive+fp8+deepcache${ISSUE6_EXTRA:+,$ISSUE6_EXTRA} \
      --out "$out/${day}_h100_${arch}_issue6.json" > "$out/${arch}_issue6.log" 2>&1; filter 10 < "$out/${arch}_issue6.log" ;;
  fp8-deepcache-profile)  # why fp8 made compile + DeepCache slower (bench/results/archive_2026-11-23_h100.md, run set 8): host (cProfile) and GPU time of both
    timeout 130 python3 bench_compile.py --arch sd15 --res 512 --warm-cache --repeats 3 --profile --profile-all --cprofile \
      --variants eager,overdrive+deepcache --out "$out/${day}_h100_sd15_dc_profile.json" > "$out/sd15_dc_profile.log" 2>&1
    timeout 240 python3 bench_compile.py --arch sd15 --res 512 --warm-cache --repeats 3 --profile --profile-all --cprofile \
      --variants overdrive,overdrive+fp8,overdrive+fp8+deepcache --out "$out/${day}_h100_sd15_fp8_dc_profile.json" \
      > "$out/sd15_fp8_dc_profile.log" 2>&1; grep '"variant"' "$out"/sd15_*profile.log | cut -c1-200 ;;
  sd15-precompile)  # issue 6 on SD1.5: does the precompiled frame's cheaper call (no guard check) lift compile + DeepCache?
    timeout "${SD15_TIMEOUT:-300}" python3 bench_compile.py --arch sd15 --res 512 --warm-cache --repeats 5 \
      --variants eager,overdrive,overdrive+deepcache,overdrive-precompile,overdrive-precompile+deepcache \
      --out "$out/${day}_h100_sd15_precompile.json" > "$out/sd15_precompile.log" 2>&1; filter 10 < "$out/sd15_precompile.log" ;;
  restart)  # issue 4: cold compile, warm restart from Overdrive's disk cache, SwitchWeights (each phase a new process)
    timeout "${RESTART_TIMEOUT:-400}" python3 bench_restart_switch.py --arch sdxl --res 1024 \
      --out "$out/${day}_h100_sdxl_restart_regional.json" > "$out/restart.log" 2>&1; filter 12 < "$out/restart.log" ;;
  restart-precompile)  # the same with CompileModel's precompile option: the restart loads the saved frame
    timeout "${RESTART_TIMEOUT:-400}" python3 bench_restart_switch.py --arch sdxl --res 1024 --precompile \
      --out "$out/${day}_h100_sdxl_restart_precompile.json" > "$out/restart_precompile.log" 2>&1
    filter 12 < "$out/restart_precompile.log" ;;
  quant-vram)  # compile + fp8 after the float layers' offload fix: peak VRAM and speed against compile alone
    timeout "${SDXL_TIMEOUT:-300}" python3 bench_compile.py --arch sdxl --res 1024 --warm-cache \
      --variants eager,overdrive+fp8 --out "$out/${day}_h100_sdxl_fp8_vram.json" > "$out/sdxl_fp8_vram.log" 2>&1
    filter 8 < "$out/sdxl_fp8_vram.log" ;;
  diffusers)  # issue 9's one run; the peer as diffusers' torch.compile docs show it; quantization last (new fp8 path)
    timeout 440 python3 bench_diffusers.py --variants eager,overdrive,peer,overdrive+quant+deepcache \
      --peer-mode reduce-overhead --warm-variants overdrive \
      --out "$out/${day}_h100_diffusers_sdxl_all.json" > "$out/diffusers.log" 2>&1; filter 12 < "$out/diffusers.log" ;;
  diffusers-flat)  # issue 9: is Overdrive's per-image gap to the peer the regions? One flat graph beside them, warm
    # compiles skipped (measured in run set 5 of the archive) so that the five rows fit one call
    timeout "${DIFFUSERS_TIMEOUT:-580}" python3 bench_diffusers.py \
      --variants eager,peer,overdrive-flat,overdrive,overdrive+quant+deepcache --peer-mode reduce-overhead --no-warm \
      --out "$out/${day}_h100_diffusers_sdxl_flat.json" > "$out/diffusers_flat.log" 2>&1; filter 12 < "$out/diffusers_flat.log" ;;
  diffusers-restart)  # the diffusers API against eager and the peer; then a restart and a switch with the disk cache warm
    timeout 340 python3 bench_diffusers.py --variants eager,peer,overdrive,overdrive+quant+deepcache --peer-mode default \
      --no-warm --out "$out/${day}_h100_diffusers_sdxl_all.json" > "$out/diffusers.log" 2>&1; filter 10 < "$out/diffusers.log"
    timeout 230 python3 bench_restart_switch.py --arch sdxl --res 1024 \
      --out "$out/${day}_h100_sdxl_restart_regional.json" > "$out/restart.log" 2>&1; filter 6 < "$out/restart.log" ;;
  gemm)
    timeout 90 python3 bench_quantize.py --budget-s 30 --out "$out/${day}_h100_quantize_gemm.json" 2>&1 | filter 40 ;;
  gemm-fp8)  # fp8 with static activation scales against fp16 and dynamic fp8, alone and behind a GELU (fusion)
    timeout 150 python3 bench_quantize.py --quick --formats fp8_e4m3 --budget-s 90 \
      --out "$out/${day}_h100_quantize_gemm_fp8_static.json" > "$out/quantize_gemm_fp8_static.log" 2>&1
    filter 16 < "$out/quantize_gemm_fp8_static.log" ;;
  gemm-autotune)  # do Inductor's autotuned Triton GEMM templates beat cuBLAS for fp16 / static fp8 at
    # SDXL's shapes? The same 7 shapes under the default mode and under max-autotune, one process each. Without
    # Inductor's CUDA graphs: the bench captures its own graph around each call (the archive's run set 9 "max-autotune" run
    # nested cudagraph trees inside it and timed their bookkeeping, 0.05-0.08 ms a call, not the kernels)
    for mode in ${GEMM_MODES:-default max-autotune-no-cudagraphs}; do
      timeout "${GEMM_TIMEOUT:-200}" python3 bench_quantize.py --formats fp8_e4m3 --static-only --mode $mode --budget-s 160 \
        --out "$out/${day}_h100_quantize_gemm_fp8_$mode.json" > "$out/quantize_gemm_fp8_$mode.log" 2>&1
      filter 12 < "$out/quantize_gemm_fp8_$mode.log"
    done ;;
  diffusers-autotune)  # issues 5 and 9: SDXL end to end with max-autotune, fp16 and fp8, GPU time by kernel family
    timeout "${DIFFUSERS_TIMEOUT:-580}" python3 bench_diffusers.py --profile --no-warm --peer-mode reduce-overhead \
      --variants ${DIFFUSERS_VARIANTS:-eager,overdrive,overdrive-autotune,overdrive+quant,overdrive-autotune+quant,peer} \
      --out "$out/${day}_h100_diffusers_sdxl_autotune.json" > "$out/diffusers_autotune.log" 2>&1
    filter 12 < "$out/diffusers_autotune.log" ;;
  levers)  # issue 9: per UNet call / VAE decode, do fused q/k/v, coordinate-descent tuning or cuDNN's
    # conv benchmarking put Overdrive's graph ahead of the peer's? (bench_unet_levers.py)
    timeout "${LEVERS_TIMEOUT:-570}" python3 bench_unet_levers.py \
      --variants ${LEVERS_VARIANTS:-eager,od,od+cudnn,od+fuse,od+fuse+cudnn,vae-eager,vae-od,vae-od+cudnn,vae-peer,od+cdt,peer} \
      --out "$out/${day}_h100_unet_levers.json" > "$out/unet_levers.log" 2>&1
    filter 16 < "$out/unet_levers.log" ;;
  memory)  # GPU memory a dropped compiled UNet leaves behind (probes/memory_after_release.py)
    timeout "${MEMORY_TIMEOUT:-300}" python3 probes/memory_after_release.py --out "$out/${day}_h100_memory_after_release.json" \
      > "$out/memory_after_release.log" 2>&1
    filter 8 < "$out/memory_after_release.log" ;;
  gpu-tests)
    cd .. && python3 -m pytest tests/test_quantization_gpu.py -q -p no:cacheprovider 2>&1 | tail -5 ;;
esac

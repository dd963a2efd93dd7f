source bench/device_env.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_block_graphs_gpu.py -k "out_of_memory or cannot_be_recorded or stop_during or toy_chain" 2>&1 | tail -4
BUDGET_GIB=16 VARIANTS=overdrive+fp8+attn BENCH_ARGS="--repeats 1" TAIL=14 timeout $((330-SECONDS)) bash bench/gpu_dynamic_vram.sh wan22_14b-on "$OUT"
grep -a "overdrive\|{\"variant" $OUT/*.log | grep -v "^W1" | cut -c1-300 | grep -i "graph\|stream\|fit\|fail\|variant\|memory" | head -20
echo total $SECONDS

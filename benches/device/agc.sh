#!/usr/bin/env bash
# AGC on the GPU machine (run through benches/device/run.sh exec): its Python tests on CUDA (the
# GPU's bits against the CPU's, a captured graph's replays), its cost in the AdamW step beside
# the floor on seed-500 and the MoE list (benches/torch/agc_cost.py), and memcheck and racecheck
# over its CUDA cases; logs and records under $OUT.
set -uo pipefail
c=$(cat .devbin/commit)
export PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_agc.py > "$OUT/agc-tests.log" 2>&1
tail -3 "$OUT/agc-tests.log"
for w in seed-500 qwen3-30b-a3b-ep8; do
    python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$w.json" --workload "$w" --commit "$c" \
        > "$OUT/agc-cost-$w.txt" 2>&1
    cat "$OUT/agc-cost-$w.txt"
done
for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
        python/tests/test_agc.py -k "cuda or captured" > "$OUT/$tool.log" 2>&1
    echo "$tool:"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/$tool.log" | tail -3
done

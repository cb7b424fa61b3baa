#!/usr/bin/env bash
# AGC and AdaGC on the GPU machine (run through benches/device/run.sh exec): their Python tests
# on CUDA (the GPU's bits against the CPU's, a captured graph's replays), their cost in the AdamW
# step beside the floor on seed-500 and the MoE list (benches/torch/agc_cost.py), and memcheck,
# racecheck and synccheck over their CUDA cases; logs and records under $OUT (the sanitizers' logs
# in one archive: the device tool brings back eight files, run.sh writes two).
set -uo pipefail
c=$(cat .devbin/commit)
export PYTHONUNBUFFERED=1
tests="python/tests/test_agc.py python/tests/test_adagc.py"
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib $tests > "$OUT/agc-tests.log" 2>&1
tail -3 "$OUT/agc-tests.log"
for w in seed-500 qwen3-30b-a3b-ep8; do
    python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$w.json" --workload "$w" --commit "$c" \
        > "$OUT/agc-cost-$w.txt" 2>&1
    cat "$OUT/agc-cost-$w.txt"
done
san=$(mktemp -d)
for tool in memcheck racecheck synccheck; do
    compute-sanitizer --tool "$tool" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
        $tests -k "cuda or captured" > "$san/$tool.log" 2>&1
    echo "$tool:"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$san/$tool.log" | tail -3
done
tar -czf "$OUT/sanitizers.tar.gz" -C "$san" .

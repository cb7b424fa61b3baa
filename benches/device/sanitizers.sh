#!/usr/bin/env bash
# compute-sanitizer over the Rust GPU suites and a Python CUDA subset (issue 39, item 3), and the
# spike example at GPU size; run through benches/device/run.sh exec; logs under $OUT, each tool's
# summary printed. Each run is bounded (timeout) so that the call fits the device tool's limit.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 python/examples/spike_policies.py "$OUT/spike-policies-gpu" --device cuda --d-model 512 --layers 6 \
    --batch 64 --seq 128 > "$OUT/spike-policies-gpu.txt" 2>&1
grep -E "final|matplotlib" "$OUT/spike-policies-gpu.txt"
for tool in synccheck racecheck; do
    for suite in gpu_clip gpu_optimizer gpu_capture gpu_sharded; do
        echo "== $tool $suite"
        timeout 100 compute-sanitizer --tool "$tool" ".devbin/gpu-tests/$suite" --test-threads 1 \
            > "$OUT/san-$tool-$suite.log" 2>&1
        echo "rc=$?"; grep -E "test result|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/san-$tool-$suite.log" | tail -2
    done
done
echo "== memcheck python"
timeout 200 compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -p no:cacheprovider \
    --import-mode=importlib python/tests/test_cuda_graph.py python/tests/test_optim_sgd_lion.py -k "cuda" \
    > "$OUT/san-memcheck-python.log" 2>&1
echo "rc=$?"; tail -2 "$OUT/san-memcheck-python.log"
tar czf "$OUT/sanitizer-logs.tgz" -C "$OUT" $(cd "$OUT" && ls san-*.log) && rm -f "$OUT"/san-*.log

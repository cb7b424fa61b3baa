#!/usr/bin/env bash
# Issue 39's GPU leftovers, in two device calls of under ten minutes each (run through
# benches/device/run.sh exec; logs under $OUT):
#   PART=1  the resume test on CUDA; racecheck over gpu_norm (its two giant tests apart); and, in
#           parallel for FUZZ_S seconds, the optimizer fuzzer on the GPU (seeds from SEED0, 200
#           cases a seed, GPU bits against the CPU backend) and the sharded fuzzer on the host's
#           cores (gloo, every world size, SHARDED_S seconds a world).
#   PART=2  synccheck over gpu_norm; memcheck over the Python CUDA subset (bounded); the fuzzers
#           again with other seeds.
set -uo pipefail
export PYTHONUNBUFFERED=1
part=${PART:?1 or 2}
fuzz_s=${FUZZ_S:-280}
seed0=${SEED0:-100}
pytest_q="python3 -m pytest -q -p no:cacheprovider --import-mode=importlib"
fuzz_gpu() {
    local end=$((SECONDS + fuzz_s)) seed=$seed0
    while [ $SECONDS -lt $end ]; do
        GRADCLIP_FUZZ_SEED=$seed GRADCLIP_FUZZ_CASES=200 timeout $((end - SECONDS + 30)) \
            $pytest_q python/tests/test_fuzz_optim.py -k gpu > "$OUT/fuzz-gpu-seed$seed.log" 2>&1
        echo "fuzz-gpu seed $seed rc=$? $(tail -1 "$OUT/fuzz-gpu-seed$seed.log")"
        seed=$((seed + 1))
    done
}
fuzz_sharded() {
    GRADCLIP_FUZZ_SHARDED_SEED=$((seed0 * 1000)) GRADCLIP_FUZZ_SHARDED_SECONDS=${SHARDED_S:-50} \
        $pytest_q -s python/tests/test_fuzz_sharded.py -k reference 2>&1 | grep -v "redistribut" > "$OUT/fuzz-sharded.log"
    echo "fuzz-sharded: $(grep -E '^world|passed|failed' "$OUT/fuzz-sharded.log" | tr '\n' ' ')"
}
if [ "$part" = 1 ]; then
    $pytest_q python/tests/test_resume.py > "$OUT/resume.log" 2>&1; echo "resume: $(tail -1 "$OUT/resume.log")"
    fuzz_gpu > "$OUT/fuzz-gpu-summary.txt" 2>&1 &
    fuzz_sharded > "$OUT/fuzz-sharded-summary.txt" 2>&1 &
    timeout 150 compute-sanitizer --tool racecheck .devbin/gpu-tests/gpu_norm --test-threads 1 \
        --skip one_million_tensors --skip tensor_over_2_pow_32_elements > "$OUT/san-racecheck-gpu_norm.log" 2>&1
    echo "racecheck gpu_norm rc=$?"; grep -E "test result|RACECHECK SUMMARY" "$OUT/san-racecheck-gpu_norm.log" | tail -2
    wait
else
    fuzz_gpu > "$OUT/fuzz-gpu-summary.txt" 2>&1 &
    fuzz_sharded > "$OUT/fuzz-sharded-summary.txt" 2>&1 &
    timeout 120 compute-sanitizer --tool synccheck .devbin/gpu-tests/gpu_norm --test-threads 1 \
        --skip one_million_tensors --skip tensor_over_2_pow_32_elements > "$OUT/san-synccheck-gpu_norm.log" 2>&1
    echo "synccheck gpu_norm rc=$?"; grep -E "test result|ERROR SUMMARY" "$OUT/san-synccheck-gpu_norm.log" | tail -2
    timeout 300 compute-sanitizer --tool memcheck --leak-check no $pytest_q python/tests -k cuda -x \
        --deselect python/tests/test_cuda_graph.py::test_released_graph_frees_its_tables_and_the_plan_keeps_working \
        > "$OUT/san-memcheck-python-cuda.log" 2>&1
    echo "memcheck python cuda rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/san-memcheck-python-cuda.log" | tail -3
    wait
fi
cat "$OUT/fuzz-gpu-summary.txt" "$OUT/fuzz-sharded-summary.txt"

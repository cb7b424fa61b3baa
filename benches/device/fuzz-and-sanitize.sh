#!/usr/bin/env bash
# Issue 39's GPU work in one device call of under ten minutes (run through benches/device/run.sh
# exec). Optionally a cost run first, on a quiet GPU; then every job runs in parallel, each
# bounded by its own time:
#   - the optimizer fuzzer on the GPU for FUZZ_S seconds (seeds from SEED0, 200 cases a seed, the
#     GPU's bits against the CPU backend's);
#   - the sharded fuzzer on the host's cores (gloo, every world size, SHARDED_S seconds a world);
#   - compute-sanitizer over gpu_norm (synccheck whole, racecheck over its two giant tests), the
#     sharded GPU suite (NCCL over one rank), racecheck and synccheck over AdaGC's CUDA cases,
#     one after another;
#   - memcheck over the Python CUDA subset, in MEMCHECK_SHARDS processes (the test files dealt
#     round robin), each for at most MEMCHECK_S seconds;
#   - memcheck_isolate: memcheck over the gradient-lifetime tests alone and over the compiled
#     reduce-overhead "inside" steps alone, and both files without the tool in one process (which
#     of them fails under the tool, and whether the order alone fails them).
# JOBS names the jobs to run (default: all but memcheck_isolate). With PROFILE_STATS, Nsight
# Compute first reads one update launch with the telemetry and one without (stats_kernels.py).
# The device tool brings back at most eight files: the summary is $OUT/summary.txt and every log
# is in $OUT/logs.tar.gz.
set -uo pipefail
export PYTHONUNBUFFERED=1
fuzz_s=${FUZZ_S:-480}
seed0=${SEED0:-200}
memcheck_s=${MEMCHECK_S:-480}
shards=${MEMCHECK_SHARDS:-3}
logs=$(mktemp -d)
pytest_q="python3 -m pytest -q -p no:cacheprovider --import-mode=importlib"
fuzz_gpu() {
    local end=$((SECONDS + fuzz_s)) seed=$seed0 cases=0
    while [ $((end - SECONDS)) -gt 20 ]; do
        GRADCLIP_FUZZ_SEED=$seed GRADCLIP_FUZZ_CASES=200 timeout $((end - SECONDS)) \
            $pytest_q python/tests/test_fuzz_optim.py -k gpu > "$logs/fuzz-gpu-seed$seed.log" 2>&1
        local rc=$?
        echo "fuzz-gpu seed $seed rc=$rc: $(tail -1 "$logs/fuzz-gpu-seed$seed.log")"
        seed=$((seed + 1))
    done
}
fuzz_sharded() {
    GRADCLIP_FUZZ_SHARDED_SEED=$((seed0 * 1000)) GRADCLIP_FUZZ_SHARDED_SECONDS=${SHARDED_S:-80} \
        $pytest_q -s python/tests/test_fuzz_sharded.py -k reference 2>&1 | grep -v "redistribut" > "$logs/fuzz-sharded.log"
    echo "fuzz-sharded: $(grep -E '^world|passed|failed' "$logs/fuzz-sharded.log" | tr '\n' ' ')"
}
sanitize_rust() {
    local t=.devbin/gpu-tests
    timeout "${NORM_SYNC_S:-150}" compute-sanitizer --tool synccheck $t/gpu_norm --test-threads 1 > "$logs/synccheck-gpu_norm.log" 2>&1
    echo "synccheck gpu_norm rc=$?: $(grep -E 'test result|ERROR SUMMARY' "$logs/synccheck-gpu_norm.log" | tr '\n' ' ')"
    local giant
    for giant in one_million_tensors tensor_over_2_pow_32_elements; do
        timeout "${GIANT_RACE_S:-90}" compute-sanitizer --tool racecheck $t/gpu_norm --test-threads 1 --exact "$giant" \
            > "$logs/racecheck-gpu_norm-$giant.log" 2>&1
        echo "racecheck gpu_norm $giant rc=$?: $(grep -E 'test result|RACECHECK SUMMARY' "$logs/racecheck-gpu_norm-$giant.log" | tr '\n' ' ')"
    done
    $t/gpu_sharded --test-threads 1 > "$logs/gpu_sharded.log" 2>&1
    echo "gpu_sharded rc=$?: $(grep -E 'test result' "$logs/gpu_sharded.log")"
}
sanitize_adagc() {
    # AdaGC's decide launch has barriers: racecheck and synccheck over its CUDA cases.
    for tool in racecheck synccheck; do
        timeout "${ADAGC_SAN_S:-120}" compute-sanitizer --tool "$tool" python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
            python/tests/test_adagc.py -k "cuda or captured" > "$logs/$tool-adagc.log" 2>&1
        echo "$tool adagc rc=$?: $(grep -E 'passed|failed|SUMMARY' "$logs/$tool-adagc.log" | tail -2 | tr '\n' ' ')"
    done
}
memcheck_python() {
    local files i pids=()
    files=$(cd python/tests && ls test_*.py | grep -v -e fuzz -e resume)
    for i in $(seq 0 $((shards - 1))); do
        local mine
        mine=$(echo "$files" | awk -v n="$shards" -v i="$i" 'NR % n == i { printf "python/tests/%s ", $0 }')
        timeout "$memcheck_s" compute-sanitizer --tool memcheck --leak-check no $pytest_q $mine -k cuda -rf \
            --deselect python/tests/test_cuda_graph.py::test_released_graph_frees_its_tables_and_the_plan_keeps_working \
            > "$logs/memcheck-python-$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        echo "memcheck python shard $i rc=$?: $(grep -E 'ERROR SUMMARY|passed|failed' "$logs/memcheck-python-$i.log" | tail -3 | tr '\n' ' ')"
    done
}
# On a quiet GPU first: with COST_WORKLOAD, AGC's and AdaGC's cost in the AdamW step there
# (benches/torch/agc_cost.py, its record to $OUT). Then, beside the jobs below, the newest CUDA
# cases (the unit-wise clips, SkipSpike with torch's optimizers, policies in the compiled list
# op, per-tensor norms).
if [ -n "${COST_WORKLOAD:-}" ]; then
    python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$COST_WORKLOAD.json" --workload "$COST_WORKLOAD" \
        --commit "$(cat .devbin/commit)" --rounds "${COST_ROUNDS:-7}" > "$OUT/agc-cost-$COST_WORKLOAD.txt" 2>&1
    cat "$OUT/agc-cost-$COST_WORKLOAD.txt"
fi
newest() {
    python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_adagc.py python/tests/test_agc.py \
        python/tests/test_tensor_norms.py python/tests/test_policies.py python/tests/test_compile.py \
        python/tests/test_step_stats.py python/tests/test_compile_policies.py -k "cuda or captured or gpu or reduce_overhead" > "$logs/newest-cuda.log" 2>&1
    echo "newest CUDA cases rc=$?: $(tail -1 "$logs/newest-cuda.log")"
}
memcheck_isolate() {
    local grads=python/tests/test_step_gradients.py compiled=python/tests/test_compile.py
    timeout 240 compute-sanitizer --tool memcheck --leak-check no $pytest_q $grads -k cuda -rf \
        > "$logs/memcheck-step-gradients.log" 2>&1
    echo "memcheck step_gradients rc=$?: $(grep -E 'ERROR SUMMARY|passed|failed' "$logs/memcheck-step-gradients.log" | tail -3 | tr '\n' ' ')"
    timeout 240 compute-sanitizer --tool memcheck --leak-check no $pytest_q $compiled -k "reduce_overhead and inside" -rf \
        > "$logs/memcheck-compiled-inside.log" 2>&1
    echo "memcheck compiled inside rc=$?: $(grep -E 'ERROR SUMMARY|passed|failed' "$logs/memcheck-compiled-inside.log" | tail -3 | tr '\n' ' ')"
    $pytest_q $compiled $grads -k "(reduce_overhead and inside) or cuda" -rf > "$logs/compiled-then-gradients.log" 2>&1
    echo "no tool, compiled then gradients rc=$?: $(tail -1 "$logs/compiled-then-gradients.log")"
}
profile_stats() {
    local stats
    for stats in "" --stats; do
        ncu --clock-control none --kernel-name regex:gradclip_adam --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
            python3 benches/torch/stats_kernels.py .devbin/w-seed.json $stats > "$OUT/ncu-adam${stats:+-stats}.txt" 2>&1
        echo "ncu adam${stats:+ stats} rc=$?"
    done
}
[ -n "${PROFILE_STATS:-}" ] && profile_stats
jobs=${JOBS:-newest fuzz_gpu fuzz_sharded memcheck_python sanitize_adagc sanitize_rust}
for job in $jobs; do
    "$job" > "$logs/summary-$job.txt" 2>&1 &
done
wait
cat "$logs"/summary-*.txt | tee "$OUT/summary.txt"
tar -czf "$OUT/logs.tar.gz" -C "$logs" .

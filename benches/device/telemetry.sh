#!/usr/bin/env bash
# The step telemetry's checks and costs on the GPU machine (run through benches/device/run.sh
# exec, which sets up the wheel and libraries): the Rust GPU suites, the telemetry and
# parameter-group Python tests on CUDA, then optim_compare.py's update="gradclip" rows (with and
# without stats=True) and param_groups.py (465 groups), logs and records under $OUT.
set -uo pipefail
c=$(cat .devbin/commit)
export PYTHONUNBUFFERED=1
(time .devbin/gpu_backend --test-threads 1) > "$OUT/gpu-tests.log" 2>&1
grep -E "^== |test result" "$OUT/gpu-tests.log" | paste - - | cut -c1-120
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_step_stats.py \
    python/tests/test_optim_groups.py >> "$OUT/gpu-tests.log" 2>&1
tail -2 "$OUT/gpu-tests.log"
python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/optim-compare.json" --commit "$c" \
    --rows "update='gradclip'" > "$OUT/optim-compare.txt" 2>&1
grep -E "bf16|f32|gradclip" "$OUT/optim-compare.txt"
python3 benches/torch/param_groups.py "$OUT/param-groups.json" --commit "$c" > "$OUT/param-groups.txt" 2>&1
grep "^groups" "$OUT/param-groups.txt" | cut -c1-110
# The stats kernels under compute-sanitizer: the Rust optimizer suite (the GPU's records against
# the CPU's, runs out of f32's range included) and the Python telemetry cases on CUDA.
compute-sanitizer --tool memcheck --leak-check no .devbin/gpu-tests/gpu_optimizer --test-threads 1 \
    > "$OUT/memcheck.log" 2>&1
tail -2 "$OUT/memcheck.log"
compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
    python/tests/test_step_stats.py -k "cuda or captured" >> "$OUT/memcheck.log" 2>&1
tail -2 "$OUT/memcheck.log"

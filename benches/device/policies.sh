#!/usr/bin/env bash
# The clip policies' checks and costs on the GPU machine (run through benches/device/run.sh
# exec): every Rust GPU suite, the policies' Python tests on CUDA (the GPU's bits against the
# CPU's, a captured step's replays), optim_compare.py's update="gradclip" rows with and without
# the policies on seed-500 and the MoE list, and memcheck over the policies' CUDA cases; logs and
# records under $OUT.
set -uo pipefail
c=$(cat .devbin/commit)
export PYTHONUNBUFFERED=1
(time .devbin/gpu_backend --test-threads 1) > "$OUT/gpu-tests.log" 2>&1
grep -E "^== |test result" "$OUT/gpu-tests.log" | paste - - | cut -c1-120
python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_policies.py \
    python/tests/test_step_stats.py >> "$OUT/gpu-tests.log" 2>&1
tail -2 "$OUT/gpu-tests.log"
for w in seed-500 qwen3-30b-a3b-ep8; do
    python3 benches/torch/optim_compare.py .devbin/w-all.json "$OUT/optim-compare-$w.json" --workload "$w" \
        --dtypes bf16 --commit "$c" --rows "update='gradclip'), " > "$OUT/optim-compare-$w.txt" 2>&1
    echo "$w"; grep -E "tensors|gradclip" "$OUT/optim-compare-$w.txt"
done
compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
    python/tests/test_policies.py -k "cuda or gpu or captured" > "$OUT/memcheck.log" 2>&1
tail -2 "$OUT/memcheck.log"
# The policies' launch is one block with barriers: synccheck over the optimizer suite (its
# policies test moves AutoClip's history in several windows).
compute-sanitizer --tool synccheck .devbin/gpu-tests/gpu_optimizer --test-threads 1 > "$OUT/synccheck.log" 2>&1
tail -2 "$OUT/synccheck.log"

#!/usr/bin/env bash
# AGC and AdaGC folded into gradclip's update, on the GPU machine (run through run.sh exec), in
# two calls:
#   PART=tests-ab  the CUDA tests of the fold, of AGC, of the optimizers and of the telemetry (the
#                  update's walk changed), the Rust GPU optimizer suite, then the one-group step
#                  against the previous commit's wheel (.devbin/variants/base/*.whl:
#                  optim_compare.py's update="gradclip" rows, bf16 and f32, interleaved twice)
#   PART=cost      with STATS=1 first the telemetry's cost (optim_compare.py's update="gradclip"
#                  rows, with and without stats=True) and the 465-group model (param_groups.py:
#                  GPU ms, host ms, kernels); then the folds' CUDA tests (the GPU's bits against
#                  the CPU's), then AGC's and AdaGC's cost in the AdamW step beside its floor
#                  (agc_cost.py, AGC_ROUNDS rounds (5): 2 GB prefixes of seed-500 and the MoE
#                  list, which fit an 80 GB H100: its six optimizers hold about 15x the
#                  gradients' bytes; GRAD_GB=6 on an H200). `PART=cost GRAD_GB=6 STATS=1` gives
#                  the H200 figures issues 37 and 38 still ask, most wanted first.
#   PART=cost-ab   the CUDA tests of AGC, AdaGC, the fold and the optimizers, the Rust GPU
#                  optimizer suite, then agc_cost.py against the previous commit's wheel
#                  (.devbin/variants/base/*.whl), interleaved AB_ROUNDS times (2), and the one-group step's
#                  update="gradclip" rows against it (the update's walk changed)
# Logs in $OUT/logs.tar.gz, records' JSON in $OUT.
set -uo pipefail
c=$(cat .devbin/commit); D=$OUT/d; mkdir -p "$D"
export PYTHONUNBUFFERED=1
# The CUDA cases of the given test files, the Rust GPU optimizer suite, then the base wheel
# installed at /tmp/site-base.
tests_and_base() {
    timeout 240 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib "$@" \
        -k "cuda or captured or folded" > "$D/tests.log" 2>&1
    echo "python CUDA tests rc=$?: $(tail -1 "$D/tests.log")"
    timeout 120 .devbin/gpu-tests/gpu_optimizer --test-threads 1 > "$D/gpu-optimizer.log" 2>&1
    echo "gpu_optimizer rc=$?: $(grep 'test result' "$D/gpu-optimizer.log")"
    python3 -m pip install -q --no-index --no-deps --target /tmp/site-base .devbin/variants/base/*.whl
}
# The one-group step's update="gradclip" rows, the base wheel then this commit's, as $OUT/ab-V$1.json.
step_ab() {
    for v in base new; do site=/tmp/gradclip-site; [ $v = base ] && site=/tmp/site-base
        PYTHONPATH=$site timeout 100 python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/ab-$v$1.json" \
            --rows "update='gradclip'" --commit "$([ $v = base ] && cat .devbin/variants/base/commit || echo "$c")" > "$D/ab-$v$1.txt" 2>&1
        echo "== step $v$1 rc=$?"; grep -E "gradclip" "$D/ab-$v$1.txt" | cut -c1-150
    done
}
t=python/tests
if [ "${PART:-tests-ab}" = tests-ab ]; then
    tests_and_base $t/test_unit_clip_folded.py $t/test_agc.py $t/test_step_stats.py $t/test_optim_sgd_lion.py $t/test_optim.py
    for r in 1 2; do step_ab "-$r"; done
elif [ "$PART" = cost-ab ]; then
    tests_and_base $t/test_unit_clip_folded.py $t/test_agc.py $t/test_adagc.py $t/test_optim.py $t/test_optim_sgd_lion.py
    for r in $(seq "${AB_ROUNDS:-2}"); do for v in base new; do
        site=/tmp/gradclip-site; cv=$c; [ $v = base ] && site=/tmp/site-base && cv=$(cat .devbin/variants/base/commit)
        for w in ${AGC_WORKLOADS:-seed-500 qwen3-30b-a3b-ep8}; do
            PYTHONPATH=$site timeout 100 python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$w-$v-$r.json" \
                --workload "$w" --grad-gb "${GRAD_GB:-2}" --rounds 3 --commit "$cv" > "$D/agc-cost-$w-$v-$r.txt" 2>&1
            echo "== $w $v round $r rc=$?"; grep -E "AGC|AdaGC" "$D/agc-cost-$w-$v-$r.txt" | grep -v timm | cut -c1-100
        done
    done; done
    step_ab ""
else
    if [ -n "${STATS:-}" ]; then
        timeout 150 python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/telemetry.json" --rows "update='gradclip'" \
            --commit "$c" > "$D/telemetry.txt" 2>&1
        echo "== telemetry rc=$?"; grep -E "gradclip" "$D/telemetry.txt" | cut -c1-150
        timeout 120 python3 benches/torch/param_groups.py "$OUT/param-groups.json" --commit "$c" > "$D/param-groups.txt" 2>&1
        echo "== groups rc=$?"; grep "^groups" "$D/param-groups.txt" | cut -c1-120
    fi
    timeout 200 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_unit_clip_folded.py \
        python/tests/test_agc.py python/tests/test_adagc.py -k "cuda or captured or folded" > "$D/fold-tests.log" 2>&1
    echo "fold CUDA tests rc=$?: $(tail -1 "$D/fold-tests.log")"
    for w in ${AGC_WORKLOADS:-seed-500 qwen3-30b-a3b-ep8}; do
        timeout 240 python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$w.json" --workload "$w" \
            --grad-gb "${GRAD_GB:-2}" --rounds "${AGC_ROUNDS:-5}" --commit "$c" > "$D/agc-cost-$w.txt" 2>&1
        echo "== $w rc=$?"; tail -14 "$D/agc-cost-$w.txt"
    done
fi
tar -czf "$OUT/logs.tar.gz" -C "$D" .; rm -rf "$D"

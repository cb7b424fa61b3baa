#!/usr/bin/env bash
# The telemetry kernels of kernel variants (.devbin/variants/NAME, build-variant.sh) against
# .devbin's own, in one device call (run through run.sh exec). For each variant that carries
# its GPU tests: its Rust GPU optimizer suite and the telemetry tests on CUDA. Then
# optim_compare.py's update="gradclip" rows (the step with and without stats=True) in $DTYPES
# (bf16), main and every variant interleaved $ROUNDS times (2), and, with PARAM_GROUPS=1, the
# 465-group model (param_groups.py) of main and each variant (or of PARAM_GROUPS_VARIANTS). A variant whose `what` says
# DIAGNOSTIC gives wrong records by design: timings only.
#   VARIANTS="a b" (default: every folder of .devbin/variants)
# Logs in $OUT/logs.tar.gz, records' JSON in $OUT/ab/.
set -uo pipefail
V=.devbin/variants; D=$OUT/d; mkdir -p "$D" "$OUT/ab"
export PYTHONUNBUFFERED=1
variants=${VARIANTS:-$(ls $V)}
for v in $variants; do
    python3 -m pip install -q --no-index --no-deps --target "/tmp/site-$v" $V/$v/*.whl
    echo "== $v: $(cat $V/$v/what)"
    if [ -x "$V/$v/gpu-tests/gpu_optimizer" ]; then
        timeout 150 "$V/$v/gpu-tests/gpu_optimizer" --test-threads 1 > "$D/$v-gpu-optimizer.log" 2>&1
        echo "$v gpu_optimizer rc=$?: $(grep 'test result' "$D/$v-gpu-optimizer.log")"
        PYTHONPATH=/tmp/site-$v timeout 150 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
            python/tests/test_step_stats.py python/tests/test_optim_groups.py -k "cuda or captured" > "$D/$v-step-stats.log" 2>&1
        echo "$v step_stats rc=$?: $(tail -1 "$D/$v-step-stats.log")"
    fi
done
site_of() { [ "$1" = main ] && echo /tmp/gradclip-site || echo "/tmp/site-$1"; }
commit_of() { [ "$1" = main ] && cat .devbin/commit || echo "$1 $(head -1 $V/$1/commit)"; }
for r in $(seq "${ROUNDS:-2}"); do for v in main $variants; do
    PYTHONPATH=$(site_of "$v") timeout 120 python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/ab/$v-$r.json" \
        --dtypes "${DTYPES:-bf16}" --rows "update='gradclip'" --commit "$(commit_of "$v")" > "$D/ab-$v-$r.txt" 2>&1
    echo "== $v round $r rc=$?"; grep -E "gradclip" "$D/ab-$v-$r.txt" | cut -c1-150
done; done
if [ -n "${PARAM_GROUPS:-}" ]; then for v in main ${PARAM_GROUPS_VARIANTS:-$variants}; do
    PYTHONPATH=$(site_of "$v") timeout 120 python3 benches/torch/param_groups.py "$OUT/ab/groups-$v.json" \
        --commit "$(commit_of "$v")" > "$D/groups-$v.txt" 2>&1
    echo "== groups $v rc=$?"; grep "^groups" "$D/groups-$v.txt" | cut -c1-110
done; fi
tar -czf "$OUT/logs.tar.gz" -C "$D" .; rm -rf "$D"

#!/usr/bin/env bash
# The figures issues 37 and 38 ask of an H200, in one device call (run through run.sh exec),
# most wanted first: the step's telemetry cost (optim_compare.py's update="gradclip" rows, with
# and without stats=True, bf16 and f32), the 465-group model (param_groups.py: GPU ms, host ms,
# kernels), AGC and AdaGC folded into AdamW on GRAD_GB prefixes of seed-500 and the MoE list
# (agc_cost.py; 6 on an H200: an H100 holds 2), then the Rust GPU optimizer suite.
# Records' JSON in $OUT, logs in $OUT/logs.tar.gz.
set -uo pipefail
c=$(cat .devbin/commit); D=$OUT/d; mkdir -p "$D"
export PYTHONUNBUFFERED=1
timeout 150 python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/telemetry.json" --rows "update='gradclip'" \
    --commit "$c" > "$D/telemetry.txt" 2>&1
echo "== telemetry rc=$?"; grep -E "gradclip" "$D/telemetry.txt" | cut -c1-150
timeout 120 python3 benches/torch/param_groups.py "$OUT/param-groups.json" --commit "$c" > "$D/param-groups.txt" 2>&1
echo "== groups rc=$?"; grep "^groups" "$D/param-groups.txt" | cut -c1-120
for w in seed-500 qwen3-30b-a3b-ep8; do
    timeout 150 python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$w.json" --workload "$w" \
        --grad-gb "${GRAD_GB:-6}" --rounds 3 --commit "$c" > "$D/agc-cost-$w.txt" 2>&1
    echo "== agc $w rc=$?"; grep -E "AGC|AdaGC|floor" "$D/agc-cost-$w.txt" | grep -v timm | cut -c1-110
done
timeout 100 .devbin/gpu-tests/gpu_optimizer --test-threads 1 > "$D/gpu-optimizer.log" 2>&1
echo "gpu_optimizer rc=$?: $(grep 'test result' "$D/gpu-optimizer.log")"
tar -czf "$OUT/logs.tar.gz" -C "$D" .; rm -rf "$D"

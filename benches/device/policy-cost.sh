#!/usr/bin/env bash
# The clip policies' cost in gradclip's AdamW step, interleaved with the fixed clip's
# (benches/torch/policy_cost.py), on seed-500 and the MoE list; run through
# benches/device/run.sh exec; records under $OUT.
set -uo pipefail
c=$(cat .devbin/commit)
for w in seed-500 qwen3-30b-a3b-ep8; do
    python3 benches/torch/policy_cost.py .devbin/w-all.json "$OUT/policy-cost-$w.json" --workload "$w" --commit "$c" \
        > "$OUT/policy-cost-$w.txt" 2>&1
    cat "$OUT/policy-cost-$w.txt"
done

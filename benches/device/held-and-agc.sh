#!/usr/bin/env bash
# One device call: why a gradient outlives a clip under compute-sanitizer (held_gradient.py, with
# and without memcheck), then AGC's and AdaGC's cost in the AdamW step on a 2 GB prefix of
# seed-500 and of the MoE list (agc_cost.py; fits an 80 GB H100). Run through run.sh exec.
set -uo pipefail
D=$OUT/d; mkdir -p "$D"
timeout 90 compute-sanitizer --tool memcheck --leak-check no python3 benches/device/held_gradient.py > "$D/held-memcheck.txt" 2>&1
head -90 "$D/held-memcheck.txt" | cut -c1-220
for w in ${AGC_WORKLOADS:-seed-500 qwen3-30b-a3b-ep8}; do
    timeout 160 python3 benches/torch/agc_cost.py .devbin/w-all.json "$OUT/agc-cost-$w.json" --workload "$w" --grad-gb 2 \
        --rounds 5 --commit "$(cat .devbin/commit)" > "$D/agc-cost-$w.txt" 2>&1
    echo "== $w rc=$?"; tail -14 "$D/agc-cost-$w.txt"
done
tar -czf "$OUT/logs.tar.gz" -C "$D" .; rm -rf "$D"

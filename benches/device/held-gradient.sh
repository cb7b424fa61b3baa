#!/usr/bin/env bash
# One device call: why a gradient outlives a clip under compute-sanitizer (held_gradient.py, with
# and without memcheck). Run through run.sh exec. (AGC's and AdaGC's cost: agc-fold.sh.)
set -uo pipefail
D=$OUT/d; mkdir -p "$D"
timeout 60 python3 benches/device/held_gradient.py > "$D/held-plain.txt" 2>&1
tail -4 "$D/held-plain.txt"
timeout 90 compute-sanitizer --tool memcheck --leak-check no python3 benches/device/held_gradient.py > "$D/held-memcheck.txt" 2>&1
head -90 "$D/held-memcheck.txt" | cut -c1-220
tar -czf "$OUT/logs.tar.gz" -C "$D" .; rm -rf "$D"

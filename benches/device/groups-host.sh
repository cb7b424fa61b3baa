#!/usr/bin/env bash
# The host time of the 465-group step on the GPU machine (run through run.sh exec): the loop of
# benches/torch/groups_host_loop.py alone, then under py-spy (carried as .devbin/py-spy: the
# machine has no network) sampling native frames, its collapsed stacks as $OUT/groups-host.raw.
set -uo pipefail
cd benches/torch
timeout 120 python3 groups_host_loop.py 3000 | tee "$OUT/groups-host-loop.txt"
timeout 200 ../../.devbin/py-spy record --native -r 200 -f raw -o "$OUT/groups-host.raw" -- python3 groups_host_loop.py 3000 \
    > "$OUT/groups-host-pyspy.txt" 2>&1
echo "py-spy rc=$?: $(tail -2 "$OUT/groups-host-pyspy.txt")"

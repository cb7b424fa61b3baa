#!/usr/bin/env bash
# One device call (run through run.sh exec): the unit-clip folds CUDA tests (a captured folded
# step among them), then held-gradient.sh.
set -uo pipefail
D=$OUT/d; mkdir -p $D
timeout 120 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_unit_clip_folded.py > $D/fold-tests.log 2>&1; echo "fold tests rc=$?: $(tail -1 $D/fold-tests.log)"
grep -E "FAILED|Error" $D/fold-tests.log | head -5
bash benches/device/held-gradient.sh

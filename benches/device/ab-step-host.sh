#!/usr/bin/env bash
# A/B of the host time per call (benches/torch/step_host.py) between this tree's wheel
# (.devbin/wheels) and another commit's (.devbin/wheels-old, built there with `maturin build -o`),
# in alternated rounds in one process tree: the machine's speed moves between rounds, so only
# rounds run side by side compare. Run through run.sh's exec mode (its set-up and $OUT):
#   bash benches/device/run.sh exec bash benches/device/ab-step-host.sh OLD_COMMIT ROUNDS [STEP_HOST ARGS...]
set -uo pipefail
old=${1:?the other commit}
rounds=${2:-3}
shift 2
new=$(cat .devbin/commit)
python3 -m pip install -q --no-index --no-deps --target /tmp/gradclip-old .devbin/wheels-old/*.whl
for r in $(seq 1 "$rounds"); do
    for side in old new; do
        if [ "$side" = old ]; then site=/tmp/gradclip-old c=$old; else site=/tmp/gradclip-site c=$new; fi
        PYTHONPATH=$site python3 benches/torch/step_host.py "$OUT/ab-$c-$r.json" --commit "$c" "$@" > "$OUT/ab-$c-$r.txt" 2>&1 \
            || tail -5 "$OUT/ab-$c-$r.txt"
    done
done
# The rows each side's rounds give, side by side (host us).
python3 - "$OUT" "$old" "$new" "$rounds" <<'PY'
import json, sys
out, old, new, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
for r in range(1, rounds + 1):
    rows = {c: json.load(open(f"{out}/ab-{c}-{r}.json")).get("rows", []) for c in (old, new)}
    for a, b in zip(rows[old], rows[new]):
        if a["optimizer"].startswith("gradclip") or a["optimizer"] == "torch_foreach":
            print(r, a["list"], a["case"], a["optimizer"], f"{a['host_us']:.0f}", "->", f"{b['host_us']:.0f}")
PY
(cd "$OUT" && tar czf ab-step-host.tgz ab-*.json ab-*.txt && rm -f ab-*.json ab-*.txt)

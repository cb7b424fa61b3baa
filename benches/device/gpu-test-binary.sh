#!/usr/bin/env bash
# Builds the GPU test binaries (tests/tests/gpu_*.rs, release) and prints their paths, one per
# line; used by build.sh and build-variant.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo test --release --no-run -p gradclip-tests --message-format=json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"].startswith("gpu_") and m.get("executable"):
        print(m["executable"])'

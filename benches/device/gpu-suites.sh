#!/usr/bin/env bash
# The GPU suites (tests/tests/gpu_*.rs, one binary per topic: norm, clip, optimizer, sharded,
# capture), run one after another with the same libtest arguments (a filter word, --test-threads
# 1). build.sh installs it as .devbin/gpu_backend beside .devbin/gpu-tests/; exits 1 when any
# suite failed.
here=$(cd "$(dirname "$0")" && pwd)
rc=0
for suite in "$here"/gpu-tests/*; do
    echo "== $(basename "$suite")"
    "$suite" "$@" || rc=1
done
exit $rc

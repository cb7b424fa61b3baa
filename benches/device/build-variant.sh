#!/usr/bin/env bash
# Builds the current working tree's GPU test binary and wheel into .devbin/variants/NAME, beside a
# .devbin/ from build.sh, so that one device call can test and time several kernel variants
# (benches/device/run.sh variants). Needs maturin on PATH or MATURIN=/path/to/maturin.
#   benches/device/build-variant.sh NAME "what differs from main"
set -euo pipefail
name=${1:?variant name}
what=${2:?one line saying what the variant changes}
cd "$(dirname "$0")/../.."
out=.devbin/variants/$name
rm -rf "$out" && mkdir -p "$out"
test_bins=$(bash benches/device/gpu-test-binary.sh)
mkdir -p "$out/gpu-tests"
for b in $test_bins; do cp "$b" "$out/gpu-tests/$(basename "$b" | sed 's/-[0-9a-f]*$//')"; done
cp benches/device/gpu-suites.sh "$out/gpu_backend"
strip "$out"/gpu-tests/*
(cd python && "${MATURIN:-maturin}" build --release -q -o "../$out")
{ git rev-parse --short HEAD; git diff --stat HEAD | tail -1; } > "$out/commit"
echo "$what" > "$out/what"
ls -l "$out"

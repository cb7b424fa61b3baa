#!/usr/bin/env bash
# Builds, on a machine with the Rust toolchain, what benches/device/run.sh needs on a GPU machine
# that has none: the GPU test binaries (and their runner, .devbin/gpu_backend), gradclip-bench, the abi3 wheel and the workload shapes,
# stripped, in .devbin/ (git-ignored; pass it in the device tool's `carry`).
# Needs maturin on PATH or MATURIN=/path/to/maturin.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.devbin
rm -rf "$out" && mkdir -p "$out/wheels"
test_bins=$(bash benches/device/gpu-test-binary.sh)
cargo build --release -q -p gradclip-bench
# The GPU suites, one binary per topic, and the runner that runs them all (.devbin/gpu_backend).
mkdir -p "$out/gpu-tests"
for b in $test_bins; do cp "$b" "$out/gpu-tests/$(basename "$b" | sed 's/-[0-9a-f]*$//')"; done
cp benches/device/gpu-suites.sh "$out/gpu_backend"
cp target/release/gradclip-bench "$out/"
strip "$out"/gpu-tests/* "$out/gradclip-bench"
(cd python && "${MATURIN:-maturin}" build --release -q -o "../$out/wheels")
"$out/gradclip-bench" --preset all,small-1000 --dump-workloads "$out/w-all.json"
"$out/gradclip-bench" --preset seed-500 --dump-workloads "$out/w-seed.json"
git rev-parse --short HEAD > "$out/commit"
ls -l "$out" "$out/wheels"

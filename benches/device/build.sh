#!/usr/bin/env bash
# Builds, on a machine with the Rust toolchain, what benches/device/run.sh needs on a GPU machine
# that has none: the GPU test binary, gradclip-bench, the abi3 wheel and the workload shapes,
# stripped, in .devbin/ (git-ignored; pass it in the device tool's `carry`).
# Needs maturin on PATH or MATURIN=/path/to/maturin.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=.devbin
rm -rf "$out" && mkdir -p "$out/wheels"
test_bin=$(bash benches/device/gpu-test-binary.sh)
cargo build --release -q -p gradclip-bench
cp "$test_bin" "$out/gpu_backend"
cp target/release/gradclip-bench "$out/"
strip "$out/gpu_backend" "$out/gradclip-bench"
(cd python && "${MATURIN:-maturin}" build --release -q -o "../$out/wheels")
"$out/gradclip-bench" --preset all,small-1000 --dump-workloads "$out/w-all.json"
"$out/gradclip-bench" --preset seed-500 --dump-workloads "$out/w-seed.json"
git rev-parse --short HEAD > "$out/commit"
ls -l "$out" "$out/wheels"

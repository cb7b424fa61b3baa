#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .devbin/ from benches/device/build.sh:
#   benches/device/run.sh tests   the Rust GPU suite and the whole Python suite
#   benches/device/run.sh bench   gradclip-bench on every preset, torch_compare.py, host_profile.py
#   benches/device/run.sh graphs  compute-sanitizer memcheck on the CUDA-graph tests (Rust and Python)
#   benches/device/run.sh sharded two GPUs: the multi-GPU tests, sharded_compare.py on 2 ranks and 1, train_fsdp.py
#   benches/device/run.sh regress seed-500 only: gradclip-bench, torch_compare.py, host_profile.py
#   benches/device/run.sh optim   optim_compare.py (clip + AdamW step, bf16 and f32), train_gpt.py with gradclip's AdamW
#   benches/device/run.sh optim-presets  optim_compare.py on the other presets
#   benches/device/run.sh adam    the Adam tests (Rust, Python on CUDA), the same under memcheck, update="gradclip" timings
#   benches/device/run.sh one-gpu-sharded  the sharded paths' CUDA half on one GPU: the Rust GPU suite, the
#                                 combine on CUDA, four gloo ranks sharing the GPU, a one-rank NCCL world
#   benches/device/run.sh exec CMD...  CMD in the set-up environment (the wheel on PYTHONPATH, libcuda, libnccl)
#   benches/device/run.sh variants  each kernel variant of .devbin/variants/ (build-variant.sh) and .devbin's own:
#                                 the Adam bit test, test_optim.py and optim_compare.py's update="gradclip" rows
# Any other word does the set-up alone. SHARDED_REPEATS=N runs the two-rank comparison N times (torch's time varies).
# Logs and records go to $OUT (the device tool brings them back). No network, no Rust needed.
set -uo pipefail
what=${1:?tests or bench}
: "${OUT:?set OUT to a folder for the results}"
# cudarc loads libcuda.so; the driver ships libcuda.so.1 only.
mkdir -p /tmp/libcuda
for d in /usr/lib/x86_64-linux-gnu /usr/local/nvidia/lib64 /usr/lib64; do
    [ -e "$d/libcuda.so.1" ] && ln -sf "$d/libcuda.so.1" /tmp/libcuda/libcuda.so && break
done
# cudarc's NCCL loads libnccl.so: torch's wheels ship libnccl.so.2.
nccl_lib=$(python3 -c "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$nccl_lib" ] && [ -e "$nccl_lib/libnccl.so.2" ] && ln -sf "$nccl_lib/libnccl.so.2" /tmp/libcuda/libnccl.so
export LD_LIBRARY_PATH=/tmp/libcuda:${LD_LIBRARY_PATH:-}
# Two GPUs of one host: no NVLink multicast (see the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/gradclip-site .devbin/wheels/*.whl
export PYTHONPATH=/tmp/gradclip-site
cp .devbin/commit "$OUT/commit" 2>/dev/null
nvidia-smi -L > "$OUT/gpus.txt"
case $what in
tests)
    (time .devbin/gpu_backend --test-threads 1) > "$OUT/gpu-tests.log" 2>&1
    tail -3 "$OUT/gpu-tests.log"
    (time python3 -m pytest -q -rs --import-mode=importlib -p no:cacheprovider python/tests) > "$OUT/python-tests.log" 2>&1
    tail -3 "$OUT/python-tests.log"
    ;;
bench)
    .devbin/gradclip-bench --preset all --json "$OUT/bench-all-presets.json" > "$OUT/bench-all-presets.txt" 2>&1
    tail -3 "$OUT/bench-all-presets.txt"
    python3 benches/torch/torch_compare.py .devbin/w-all.json "$OUT/torch-compare.json" 10 --compile-max-tensors 0 > "$OUT/torch-compare.txt" 2>&1
    tail -3 "$OUT/torch-compare.txt"
    python3 benches/torch/host_profile.py "$OUT/host-profile.json" > "$OUT/host-profile.txt" 2>&1
    tail -4 "$OUT/host-profile.txt"
    ;;
graphs)
    compute-sanitizer --tool memcheck --leak-check no .devbin/gpu_backend --test-threads 1 graph_capture > "$OUT/graphs-memcheck-rust.log" 2>&1
    tail -4 "$OUT/graphs-memcheck-rust.log"
    compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q --import-mode=importlib -p no:cacheprovider \
        python/tests/test_cuda_graph.py -k "not thousand" > "$OUT/graphs-memcheck-python.log" 2>&1
    tail -4 "$OUT/graphs-memcheck-python.log"
    ;;
sharded)
    export PYTHONUNBUFFERED=1 GRADCLIP_COMMIT=$(cat .devbin/commit)
    if [ -z "${SKIP_TESTS:-}" ]; then
        .devbin/gpu_backend --test-threads 1 second_device > "$OUT/two-gpu-rust.log" 2>&1
        .devbin/gpu_backend --test-threads 1 two_gpus >> "$OUT/two-gpu-rust.log" 2>&1
        grep "test result" "$OUT/two-gpu-rust.log"
        python3 -m pytest -q -rs --import-mode=importlib -p no:cacheprovider python/tests/test_sharded_placements.py \
            ${TESTS_ALL:+python/tests/test_distributed.py python/tests/test_multi_device.py} > "$OUT/two-gpu-python.log" 2>&1
        tail -2 "$OUT/two-gpu-python.log"
    fi
    for r in $(seq 1 "${SHARDED_REPEATS:-1}"); do
        sfx=$([ "$r" = 1 ] && echo "" || echo "-run$r")
        python3 -m torch.distributed.run --nproc-per-node 2 benches/torch/sharded_compare.py "$OUT/sharded-x2$sfx.json" > "$OUT/sharded-x2$sfx.txt" 2>&1
        grep -v "^W1" "$OUT/sharded-x2$sfx.txt" | grep "_ms\|speedup\|ratio"
    done
    python3 -m torch.distributed.run --nproc-per-node 1 benches/torch/sharded_compare.py "$OUT/sharded-x1.json" > "$OUT/sharded-x1.txt" 2>&1
    grep -A20 one_rank "$OUT/sharded-x1.txt"
    # At most 8 files come back: the sharded records travel as one archive.
    (cd "$OUT" && tar czf sharded.tgz sharded-x* two-gpu-* 2>/dev/null && rm -f sharded-x* two-gpu-*)
    if [ -z "${SKIP_TRAIN:-}" ]; then
        python3 -m torch.distributed.run --nproc-per-node 2 python/examples/train_fsdp.py --device cuda > "$OUT/train-fsdp-x2.txt" 2>&1
        tail -2 "$OUT/train-fsdp-x2.txt"
    fi
    ;;
regress)
    .devbin/gradclip-bench --preset seed-500 --json "$OUT/bench-seed-500.json" > "$OUT/bench-seed-500.txt" 2>&1
    tail -12 "$OUT/bench-seed-500.txt"
    python3 benches/torch/torch_compare.py .devbin/w-seed.json "$OUT/torch-compare-seed-500.json" 10 --compile-max-tensors 0 > "$OUT/torch-compare-seed-500.txt" 2>&1
    tail -6 "$OUT/torch-compare-seed-500.txt"
    python3 benches/torch/host_profile.py "$OUT/host-profile.json" > "$OUT/host-profile.txt" 2>&1
    tail -4 "$OUT/host-profile.txt"
    ;;
optim)
    python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/optim-compare.json" --probe --commit "$(cat .devbin/commit)" > "$OUT/optim-compare.txt" 2>&1
    tail -14 "$OUT/optim-compare.txt"
    python3 python/examples/train_gpt.py --device cuda --optimizer gradclip > "$OUT/train-gpt-optim.txt" 2>&1
    tail -2 "$OUT/train-gpt-optim.txt"
    python3 python/examples/train_gpt.py --device cuda --optimizer gradclip --update torch > "$OUT/train-gpt-optim-torch-update.txt" 2>&1
    tail -2 "$OUT/train-gpt-optim-torch-update.txt"
    ;;
optim-presets)
    # optim_compare.py on every other preset of gradclip-bench (each in its own dtype; a prefix
    # of at most 10.3 GB of gradients, the whole list when smaller), all rows.
    for w in llama3-70b-fsdp8:f32 qwen3-30b-a3b-ep8:bf16 lora-70b-r16:f32 gpt2-124m:f32 mixed:bf16 small-1000x1024-f32:f32; do
        python3 benches/torch/optim_compare.py .devbin/w-all.json "$OUT/optim-${w%%:*}.json" --workload "${w%%:*}" \
            --dtypes "${w##*:}" --commit "$(cat .devbin/commit)" > "$OUT/optim-${w%%:*}.txt" 2>&1
        echo "== ${w%%:*} (${w##*:})"; grep "x$" "$OUT/optim-${w%%:*}.txt"
    done
    (cd "$OUT" && tar czf optim-presets.tgz optim-*.json optim-*.txt && rm -f optim-*.json optim-*.txt)
    ;;
adam)
    # The optimizer's kernel alone: its Rust and Python tests, the same under compute-sanitizer
    # memcheck (time-limited), and the update="gradclip" timing rows.
    .devbin/gpu_backend --test-threads 1 adam > "$OUT/rust-adam.log" 2>&1
    grep "test result" "$OUT/rust-adam.log"
    python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_optim.py > "$OUT/test-optim.log" 2>&1
    tail -n 1 "$OUT/test-optim.log"
    timeout 200 compute-sanitizer --tool memcheck --leak-check no .devbin/gpu_backend --test-threads 1 adam > "$OUT/memcheck-adam-rust.log" 2>&1
    tail -n 3 "$OUT/memcheck-adam-rust.log"
    timeout 150 compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
        python/tests/test_optim.py -k "cuda and (gradclip or scaler or tensor_learning)" > "$OUT/memcheck-adam-python.log" 2>&1
    tail -n 3 "$OUT/memcheck-adam-python.log"
    python3 benches/torch/optim_compare.py .devbin/w-seed.json "$OUT/optim-rows.json" --rows "update=" --commit "$(cat .devbin/commit)" > "$OUT/optim-rows.txt" 2>&1
    grep "x$" "$OUT/optim-rows.txt"
    ;;
variants)
    # One variant at a time: its wheel in its own site folder; the correctness runs on the last GPU
    # while the timings run on the first, when there are two.
    gpus=$(nvidia-smi -L | wc -l)
    test_gpu=$((gpus - 1))
    names="main $(ls .devbin/variants 2>/dev/null | tr '\n' ' ')"
    mkdir -p "$OUT/variants"
    for v in $names; do
        dir=.devbin/variants/$v; [ "$v" = main ] && dir=.devbin/wheels
        python3 -m pip install -q --no-index --no-deps --target "/tmp/site-$v" "$dir"/*.whl
    done
    (
        for v in $names; do
            dir=.devbin/variants/$v; [ "$v" = main ] && dir=.devbin
            site=/tmp/site-$v
            if [ -x "$dir/gpu_backend" ]; then
                CUDA_VISIBLE_DEVICES=$test_gpu "$dir/gpu_backend" --test-threads 1 adam > "$OUT/variants/$v-rust-adam.log" 2>&1
            fi
            CUDA_VISIBLE_DEVICES=$test_gpu PYTHONPATH=$site python3 -m pytest -q -p no:cacheprovider --import-mode=importlib \
                python/tests/test_optim.py > "$OUT/variants/$v-test-optim.log" 2>&1
        done
    ) &
    tests=$!
    [ "$gpus" -lt 2 ] && wait $tests
    for v in $names; do
        dir=.devbin/variants/$v; [ "$v" = main ] && dir=.devbin
        probe=$([ "$v" = main ] && echo --probe)
        echo "== $v: $(cat "$dir/what" 2>/dev/null || echo main at "$(cat .devbin/commit)")"
        CUDA_VISIBLE_DEVICES=0 PYTHONPATH=/tmp/site-$v python3 benches/torch/optim_compare.py .devbin/w-seed.json \
            "$OUT/variants/$v-optim.json" --rows "update=" $probe --commit "$v $(head -1 "$dir/commit")" > "$OUT/variants/$v-optim.txt" 2>&1
        grep "x$" "$OUT/variants/$v-optim.txt"
    done
    wait $tests
    for v in $names; do
        echo "$v: $(grep -h "test result" "$OUT/variants/$v-rust-adam.log" 2>/dev/null) $(tail -n 1 "$OUT/variants/$v-test-optim.log")"
    done
    (cd "$OUT" && tar czf variants.tgz variants && rm -rf variants)
    ;;
one-gpu-sharded)
    (time .devbin/gpu_backend --test-threads 1) > "$OUT/gpu-tests.log" 2>&1
    grep "test result" "$OUT/gpu-tests.log"
    python3 -m pytest -q -rs --import-mode=importlib -p no:cacheprovider python/tests/test_combine.py \
        python/tests/test_sharded_placements.py python/tests/test_distributed.py python/tests/test_multi_device.py \
        > "$OUT/python-sharded.log" 2>&1
    tail -3 "$OUT/python-sharded.log"
    ;;
exec)
    shift
    "$@"
    ;;
*) echo "set-up done; modes: tests, bench, graphs, sharded, one-gpu-sharded, regress, optim, optim-presets, adam, variants, exec"; exit 2 ;;
esac

#!/usr/bin/env bash
# The telemetry kernels of a variant (.devbin/variants/tally-selects, build-variant.sh) against
# .devbin's own, in one device call (run through run.sh exec): the variant's GPU optimizer suite
# and telemetry tests on CUDA, then optim_compare.py's update="gradclip" rows in bf16, main and
# variant interleaved twice; logs in $OUT/logs.tar.gz.
V=.devbin/variants/tally-selects; D=$OUT/d; mkdir -p $D
python3 -m pip install -q --no-index --no-deps --target /tmp/site-v $V/*.whl
timeout 150 $V/gpu-tests/gpu_optimizer --test-threads 1 > $D/v-gpu-optimizer.log 2>&1; echo "variant gpu_optimizer rc=$?: $(grep 'test result' $D/v-gpu-optimizer.log)"
PYTHONPATH=/tmp/site-v timeout 150 python3 -m pytest -q -p no:cacheprovider --import-mode=importlib python/tests/test_step_stats.py -k "cuda or captured" > $D/v-step-stats.log 2>&1; echo "variant step_stats: $(tail -1 $D/v-step-stats.log)"
for r in 1 2; do for v in main v; do site=/tmp/gradclip-site; [ $v = v ] && site=/tmp/site-v
PYTHONPATH=$site timeout 110 python3 benches/torch/optim_compare.py .devbin/w-seed.json $D/ab-$v-$r.json --dtypes bf16 --rows "update='gradclip'" --commit "$v" > $D/ab-$v-$r.txt 2>&1
echo "== $v round $r rc=$?"; grep -E "gradclip" $D/ab-$v-$r.txt | cut -c1-160; done; done
timeout 60 python3 benches/device/held_gradient.py > $D/held-plain.txt 2>&1; tail -4 $D/held-plain.txt
timeout 120 compute-sanitizer --tool memcheck --leak-check no python3 benches/device/held_gradient.py > $D/held-memcheck.txt 2>&1; tail -40 $D/held-memcheck.txt
tar -czf $OUT/logs.tar.gz -C $D .; rm -rf $D

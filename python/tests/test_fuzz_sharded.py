"""The sharded fuzzer (``fuzz_sharded_worker.py``) over gloo: random meshes up to eight ranks
(1-D to 3-D, sub-meshes, several meshes in one call), placements (Shard of any dimension,
nested shards, Replicate, Partial), uneven and empty shards, dtype mixes, None gradients, inf
and NaN, norm types 1, 1.5, 2, 3 and inf, and p < 1 refused; each clip against an f64 reference
from the whole tensors. CI runs a fixed seed and a bounded count per world size;
``GRADCLIP_FUZZ_SHARDED_SEED``, ``GRADCLIP_FUZZ_SHARDED_CASES`` and
``GRADCLIP_FUZZ_SHARDED_SECONDS`` (a time budget per world; the count then bounds nothing
below 10**9) run it longer."""

import os

import pytest
import torch.distributed as dist

import ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_sharded_worker.py")
SEED = int(os.environ.get("GRADCLIP_FUZZ_SHARDED_SEED", "20261205"))
SECONDS = float(os.environ.get("GRADCLIP_FUZZ_SHARDED_SECONDS", "0"))
#: Cases per world size in CI: about 10 s a world on two cores.
CASES = {2: 40, 3: 30, 4: 30, 6: 15, 8: 15}


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
@pytest.mark.parametrize("world", sorted(CASES))
def test_random_sharded_clips_equal_the_f64_reference(tmp_path, world):
    cases = int(os.environ.get("GRADCLIP_FUZZ_SHARDED_CASES", "0")) or (10**9 if SECONDS else CASES[world])
    timeout = 600 + 2 * SECONDS
    codes, outs = ranks.run_worker(WORKER, tmp_path, timeout, str(SEED + world), str(cases), str(SECONDS), world=world)
    lines = [o.read_text().splitlines() if o.exists() else [] for o in outs]
    failures = [line for rank_lines in lines for line in rank_lines if not line.startswith("cases ")]
    assert codes == [0] * world and all(lines), (codes, failures)
    assert not failures, "\n".join(failures)
    counts = {rank_lines[-1] for rank_lines in lines}
    assert len(counts) == 1, counts  # every rank ran the same cases
    ran = int(counts.pop().split()[1])
    assert ran == cases or SECONDS, f"{ran} of {cases} cases ran"
    print(f"world {world}: {ran} cases")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_the_fuzzer_catches_a_clip_by_the_local_norm(tmp_path):
    # The local-norm bug put back (the clip's all-reduces skipped): the first sharded case fails.
    env = dict(os.environ, GRADCLIP_FUZZ_SHARDED_INJECT="local")
    codes, outs = ranks.run_worker(WORKER, tmp_path, 300, str(SEED), "40", "0", world=2, env=env)
    assert codes == [0, 0]
    failures = [line for o in outs for line in o.read_text().splitlines() if not line.startswith("cases ")]
    assert any(": norm " in f for f in failures), failures

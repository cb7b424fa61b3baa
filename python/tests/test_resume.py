"""Resume equals uninterrupted: for every optimizer (AdamW, Adam with amsgrad, SGD with Nesterov
momentum, Lion) and both updates, a run cut at step 9 (the parameters and the optimizer's state
dict saved to a file, loaded by a fresh process with torch's default ``weights_only``) ends with
the parameters of the run that never stopped, to the bit, and the same count of skipped steps;
the run has two param groups, a gradient that is None on some steps and a skipped non-finite
step before the cut (``resume_worker.py``). On the CPU and, where there is one, on a CUDA device
(the state dict saved from the device and loaded back onto it). The policies' resume is
``test_policies.py``'s."""

import os
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_worker.py")


def _run(*args):
    subprocess.run([sys.executable, WORKER, *map(str, args)], check=True, timeout=300)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))])
def test_a_run_resumed_in_a_fresh_process_ends_as_the_run_that_never_stopped(tmp_path, device):
    straight, cut, resumed = tmp_path / "straight.pt", tmp_path / "cut.pt", tmp_path / "resumed.pt"
    _run(straight, "--device", device)
    _run(cut, "--device", device, "--save", cut)
    _run(resumed, "--device", device, "--resume", cut)
    a, b = torch.load(straight), torch.load(resumed)
    assert sorted(a) == sorted(b) and len(a) == 8
    for key in a:
        for i, (p, q) in enumerate(zip(a[key]["params"], b[key]["params"])):
            assert torch.equal(p, q), f"{key}: parameter {i} differs after the resume"
        assert a[key]["skipped"] == b[key]["skipped"], key
    # The skipped step is counted on both sides of the cut where gradclip's engine counts it.
    assert a["AdamW/gradclip"]["skipped"] == 1

"""What the integration tests share: the framework imported or the test skipped, except where CI
says it installed it (``GRADCLIP_REQUIRED_FRAMEWORKS``: a comma-separated list of pip names, or
``all``), where a missing framework fails the test instead of skipping it; and the relative
difference the tests allow between two runs' parameters."""

import importlib
import os

import pytest
import torch

import ranks

#: f32 parameters after the tests' 10-20 steps: at most this far apart, relative to their largest.
PARAMS_RTOL = 1e-5


def framework(module: str, distribution: str, adapter: str = None):
    """``module`` imported (and gradclip's ``adapter`` for it, which refuses a release it is not
    tested with), or the test skipped (failed when CI requires ``distribution``)."""
    required = os.environ.get("GRADCLIP_REQUIRED_FRAMEWORKS", "")
    try:
        found = importlib.import_module(module)
        if adapter is not None:
            importlib.import_module(adapter)
        return found
    except ImportError as e:
        if required == "all" or distribution in required.split(","):
            pytest.fail(f"{distribution} is required here (GRADCLIP_REQUIRED_FRAMEWORKS) and does not import: {e}")
        pytest.skip(f"{distribution}: {e}")


def relative_difference(a, b) -> float:
    """The largest difference of two lists of tensors, relative to the largest magnitude in ``a``."""
    assert len(a) == len(b)
    scale = max(float(x.detach().float().abs().max()) for x in a)
    return max(float((x.detach().float() - y.detach().float()).abs().max()) for x, y in zip(a, b)) / scale


def assert_trained_alike(stock: dict, mine: dict, rtol: float, threshold: float = 0.05) -> None:
    """Two training runs' records (``losses``, ``norms`` as logged, final ``params``) alike to
    ``rtol``, and every step of ``mine`` clipped (its norm above the clip ``threshold``)."""
    assert len(mine["losses"]) == len(stock["losses"]) > 0
    assert mine["losses"] == pytest.approx(stock["losses"], rel=rtol)
    assert mine["norms"] == pytest.approx(stock["norms"], rel=rtol)
    assert min(mine["norms"]) > threshold
    assert relative_difference(stock["params"], mine["params"]) <= rtol


def worker_records(worker: str, out_dir, timeout: float, *args: str) -> list:
    """The records (torch.save) of two ranks of the worker script ``worker`` of this folder
    (``ranks.run_worker``), after asserting that both exited 0."""
    codes, outs = ranks.run_worker(os.path.join(os.path.dirname(os.path.abspath(__file__)), worker), out_dir, timeout, *args)
    assert codes == [0, 0], codes
    return [torch.load(out, weights_only=False) for out in outs]

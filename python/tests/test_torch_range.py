"""The torch range gradclip declares is the range CI tests: pyproject's lower bound is the
oldest release in ``tested-torch.txt``, the native reads by object layout are allowed only on
releases listed there, and the torch running this suite is one gradclip supports."""

import os
import re

import torch

from gradclip import _torch_probe

HERE = os.path.dirname(os.path.abspath(__file__))


def _tested():
    with open(os.path.join(HERE, "..", "tested-torch.txt")) as f:
        rows = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return {role: version for version, role in rows}


def _release(version):
    return tuple(int(x) for x in _torch_probe.torch_release(version).split("."))


def test_the_declared_lower_bound_is_the_oldest_tested_torch():
    with open(os.path.join(HERE, "..", "pyproject.toml")) as f:
        bound = re.search(r'"torch>=([0-9.]+)"', f.read()).group(1)
    tested = _tested()
    assert set(tested) == {"oldest", "gpu-machine", "newest"}
    assert _release(bound) == _release(tested["oldest"])
    assert _release(tested["oldest"]) <= _release(tested["gpu-machine"]) <= _release(tested["newest"])


def test_native_layout_reads_are_allowed_only_on_tested_releases():
    tested = {_torch_probe.torch_release(v) for v in _tested().values()}
    assert set(_torch_probe.OBJECT_LAYOUT_VERIFIED) <= tested
    assert _torch_probe.torch_release(_tested()["oldest"]) not in _torch_probe.OBJECT_LAYOUT_VERIFIED  # 2.8 lacks the shim's reads


def test_this_torch_is_one_gradclip_supports():
    assert _release(torch.__version__) >= _release(_tested()["oldest"])

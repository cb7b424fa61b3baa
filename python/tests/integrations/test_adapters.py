"""What every adapter of ``gradclip.integrations`` shares: importing gradclip (its clip, its
optimizers, the integrations package, the adapters that need their framework only when used)
imports no framework, and an adapter refuses a framework
release it is not tested with, unless told to go on."""

import subprocess
import sys

import pytest

FRAMEWORKS = ("deepspeed", "transformers", "accelerate", "lightning", "nemo_automodel", "torchtitan")


def test_importing_gradclip_imports_no_framework():
    code = (
        "import sys, gradclip, gradclip.torch, gradclip.torch.optim, gradclip.integrations, gradclip.integrations._framework\n"
        # The adapters whose framework is needed only when used: importing them imports none.
        "import gradclip.integrations.nemo, gradclip.integrations.deepspeed\n"
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_an_untested_release_is_refused_unless_told(monkeypatch):
    from gradclip.integrations import _framework

    monkeypatch.setattr(_framework.importlib.metadata, "version", lambda name: "99.1.0")
    monkeypatch.delenv(_framework.OVERRIDE, raising=False)
    with pytest.raises(_framework.UntestedFramework, match=r"tested with pytest 8\.3.*this is 99\.1\.0.*GRADCLIP_UNTESTED_FRAMEWORKS=1"):
        _framework.require("pytest", "pytest", ("8.3",))
    monkeypatch.setenv(_framework.OVERRIDE, "1")
    assert _framework.require("pytest", "pytest", ("8.3",)) is pytest
    monkeypatch.setattr(_framework.importlib.metadata, "version", lambda name: "8.3.4+local")
    monkeypatch.delenv(_framework.OVERRIDE)
    assert _framework.require("pytest", "pytest", ("8.3",)) is pytest


def test_a_missing_framework_says_what_to_install():
    from gradclip.integrations import _framework

    with pytest.raises(ImportError, match="pip install no-such-framework-here"):
        _framework.require("no_such_framework_here", "no-such-framework-here", ("1.0",))

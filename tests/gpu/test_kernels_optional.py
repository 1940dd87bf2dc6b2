"""neorec works without triton: importing the kernels package never imports triton."""

import importlib.util
import subprocess
import sys

from neorec.embedding import kernels


def test_importing_kernels_package_does_not_import_triton():
    code = "import sys, neorec, neorec.embedding.kernels as k; k.triton_available(); print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_triton_available_is_false_without_triton(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_available() is False


def test_triton_available_needs_cuda_or_interpreter(monkeypatch):
    if importlib.util.find_spec("triton") is None:
        assert kernels.triton_available() is False
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_available() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    import torch

    assert kernels.triton_available() is torch.cuda.is_available()

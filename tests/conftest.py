import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "scripts"))             # the tools a user runs on a checkpoint


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    import common
    common.set_mean_std()                                     # ImageNet's: a test's --mean / checkpoint never leaks


def pytest_configure(config):
    config.addinivalue_line("markers", "compiles: the test runs torch.compile (every other test runs eager)")


@pytest.fixture(autouse=True)
def _eager_unless_marked(request, monkeypatch):
    """--compile is on by default with CUDA, so on a GPU host every training run of the suite would compile
    (tens of seconds each). Tests run eager, in process and in the processes they start, except those
    marked `compiles` (compiled vs eager checks)."""
    if request.node.get_closest_marker("compiles") is not None:
        yield
        return
    import torch._dynamo
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    with torch._dynamo.config.patch(disable=True):
        yield

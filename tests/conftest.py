import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Shared helpers (support.py) live here; test folders mirror the package below it.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# One thread: deterministic timings and no oversubscription when the suite shares the machine.
torch.set_num_threads(1)
torch.manual_seed(0)

_OBJECTS: list[str] = []
OBJECT_CACHE = "QUANTREE_NATIVE_OBJECT_CACHE"  # build.OBJECT_CACHE (quantree not imported here)


def pytest_configure(config):
    """One object cache for the run (the xdist workers inherit it from the controller, and
    the subprocesses tests start from them): the suite builds the same kernel library many
    times (fresh caches, rebuilds, the baseline march), each build compiling the same objects.
    Each distinct object still compiles once per run, and every build links its own library."""
    if os.environ.get(OBJECT_CACHE) or hasattr(config, "workerinput"):
        return
    _OBJECTS.append(tempfile.mkdtemp(prefix="quantree-test-objects-"))
    os.environ[OBJECT_CACHE] = _OBJECTS[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (pyproject's addopts) hands out the heaviest files first
    (``heaviest_first.py``); any other ``--dist`` is xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from heaviest_first import HeaviestFirst

    return HeaviestFirst(config, log)


def pytest_unconfigure(config):
    for path in _OBJECTS:
        os.environ.pop(OBJECT_CACHE, None)
        shutil.rmtree(path, ignore_errors=True)

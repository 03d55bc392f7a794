import os
import zlib

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    # Random inputs that differ per test case yet reproduce exactly on a rerun of that case.
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))

import zlib

import pytest
import torch

import bitsandbytes_kbit
from bitsandbytes_kbit import cextension


def cuda_ready() -> bool:
    return torch.cuda.is_available() and cextension.is_available()


requires_cuda = pytest.mark.skipif(
    not cuda_ready(),
    reason="needs a CUDA GPU and the native library (libbitsandbytes_kbit_cuda.so)",
)


def seeded(*parts) -> torch.Generator:
    """A CPU generator seeded from the test case's parameters: fresh data per case, reproducible per id."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(parts).encode()))
    return g


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(requires_cuda)


@pytest.fixture(autouse=True)
def _version_is_set():
    assert bitsandbytes_kbit.__version__

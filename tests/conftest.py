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
# tests of tensors / models spread over two devices (run on the 2-GPU machine: benchmarking/run_gpu.sh)
requires_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (device indices 0 and 1)")


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


def tiny_llama(seed: int = 0):
    """A small randomly initialised LlamaForCausalLM (2 layers, hidden 64; no downloads) for the
    transformers and PEFT tests."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # transformers initializes from the global RNG: keep it untouched
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()

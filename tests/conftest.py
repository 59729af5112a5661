import threading
import zlib

import pytest
import torch

import bitsandbytes_kbit
from bitsandbytes_kbit import cextension


def run_threads(fn, n: int) -> None:
    """fn(0) .. fn(n - 1) on n threads at once; raises the first exception any of them raised."""
    errors = []

    def body(i):
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def cuda_ready() -> bool:
    return torch.cuda.is_available() and cextension.is_available()


requires_cuda = pytest.mark.skipif(
    not cuda_ready(),
    reason="needs a CUDA GPU and the native library (libbitsandbytes_kbit_cuda.so)",
)
# tests of tensors / models spread over two devices (run on the 2-GPU machine: benchmarking/run_gpu.sh)
requires_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (device indices 0 and 1)"
)


def hopper_ready() -> bool:
    """The warp-specialised GEMM config 7 exists only on compute capability 9.0 with an sm_90a build."""
    if not cuda_ready() or torch.cuda.get_device_capability(0) != (9, 0):
        return False
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available

    return gemm_config_available(7, 0)


# tests of the Hopper-only config 7 (run on the H100 / H200 machines: benchmarking/run_gpu.sh); every other GPU
# runs the same calls through configs 0-6 and the staged path, which the other CUDA tests cover
requires_hopper = pytest.mark.skipif(
    not hopper_ready(), reason="needs a compute capability 9.0 GPU (H100/H200) and a library built for sm_90a"
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

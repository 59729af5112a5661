"""The C ABI of the native library: a handful of entry points with k, the element type and the absmax storage as
runtime arguments, one error convention (0 = success, 1 = failure with the message in ckbit_last_error, per thread),
and one test hook (ckbit_gemm_set_test_override). The argument checks run before anything touches a device, so most
of this runs wherever the library loads; the GPU tests are marked cuda."""

import ctypes as ct
import threading

import pytest
import torch

from bitsandbytes_kbit import cextension
from bitsandbytes_kbit.backends.cuda import ops as cuda_ops

needs_library = pytest.mark.skipif(not cextension.is_available(), reason="needs the native library")

# The entry points that do work, with arguments valid apart from the format codes (null pointers, n = 0 / empty
# regions: nothing is launched); fmt = (k, dtype code, absmax code).
NULL = None


def _work_calls(fmt, codebook_len=4):
    k, dtype, absmax = fmt
    return {
        "ckbit_quantize": (k, dtype, absmax, NULL, NULL, codebook_len, NULL, NULL, 0, NULL),
        "ckbit_quantize_mse": (k, dtype, absmax, NULL, NULL, codebook_len, NULL, NULL, 0, 1, 1, NULL),
        "ckbit_dequantize": (k, dtype, absmax, NULL, NULL, NULL, codebook_len, NULL, 0, NULL),
        "ckbit_dequantize_tiled": (k, dtype, absmax, NULL, NULL, NULL, codebook_len, NULL, 16, 128, 0, 0, 0, 0, NULL),
    }


def _last_error() -> str:
    return cuda_ops._entry("ckbit_last_error")().decode()


def test_the_abi_table_is_small_and_mirrors_the_codes():
    names = cuda_ops.entry_point_names()
    assert len(names) <= 20 and len(set(names)) == len(names)
    assert all(name.startswith("ckbit_") for name in names)
    assert cuda_ops._DTYPE_CODE == {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
    assert cuda_ops._ABSMAX_CODE == {torch.uint8: 0, torch.float16: 1, torch.float32: 2}


@needs_library
def test_exported_set_has_no_per_format_fan_out():
    lib = cextension.get_lib()
    assert all(hasattr(lib, name) for name in cuda_ops.entry_point_names())
    for old in ("cquantize_kbit_fp16_u8abs_k4", "cdequantize_tiled_bf16_fp16abs_k2", "ckbit_gemm_fp16_u8abs_k4"):
        assert not hasattr(lib, old), old
    assert not hasattr(lib, "ckbit_error_string")  # one error convention: ckbit_last_error


@needs_library
@pytest.mark.parametrize(
    "name", ["ckbit_quantize", "ckbit_quantize_mse", "ckbit_dequantize", "ckbit_dequantize_tiled"]
)
def test_bad_codes_fail_with_a_message_naming_the_argument(name):
    fn = cuda_ops._entry(name)
    assert fn(*_work_calls((4, 0, 0))[name]) == 0 and _last_error() == ""
    tiled = name == "ckbit_dequantize_tiled"
    cases = [
        ((7, 0, 0), "k=7"),
        ((1, 0, 0), "k=1"),
        ((4, 3 if not tiled else 2, 0), f"dtype={3 if not tiled else 2}"),
        ((4, -1, 0), "dtype=-1"),
        ((4, 0, 3 if not tiled else 2), f"absmax_format={3 if not tiled else 2}"),
    ]
    for fmt, text in cases:
        assert fn(*_work_calls(fmt)[name]) == 1, (fmt, name)
        message = _last_error()
        assert message.startswith(name + ": ") and text in message and "expected" in message, message
        assert fn(*_work_calls((4, 0, 0))[name]) == 0 and _last_error() == "", "a successful call clears the message"


@needs_library
@pytest.mark.parametrize("name", ["ckbit_quantize", "ckbit_dequantize_tiled"])
def test_codebook_longer_than_two_to_the_k_is_refused(name):
    fn = cuda_ops._entry(name)
    for k in (2, 3, 4, 5):
        assert fn(*_work_calls((k, 1, 1), codebook_len=1 << k)[name]) == 0
        assert fn(*_work_calls((k, 1, 1), codebook_len=(1 << k) + 1)[name]) == 1
        assert f"codebook_len={(1 << k) + 1}" in _last_error()


@needs_library
def test_tiled_region_and_mse_candidates_are_checked():
    tiled = cuda_ops._entry("ckbit_dequantize_tiled")
    args = list(_work_calls((3, 1, 0))["ckbit_dequantize_tiled"])
    args[10:14] = [8, 16, 0, 128]  # n_begin not on a 16-row unit
    assert tiled(*args) == 1 and "n_begin" in _last_error() and "[8:16, 0:128]" in _last_error()
    args[9] = 100  # K_dim not a multiple of 32
    assert tiled(*args) == 1 and "K_dim=100" in _last_error()
    mse = cuda_ops._entry("ckbit_quantize_mse")
    args = list(_work_calls((4, 0, 0))["ckbit_quantize_mse"])
    args[9] = -1  # below < 0
    assert mse(*args) == 1 and "below=-1" in _last_error()


@needs_library
def test_repack_and_gemm_codes_are_checked():
    repack = cuda_ops._entry("ckbit_repack")
    assert repack(6, 0, NULL, NULL, NULL, NULL, 16, 128, NULL) == 1 and "ckbit_repack: k=6" in _last_error()
    assert repack(4, 2, NULL, NULL, NULL, NULL, 16, 128, NULL) == 1 and "absmax_format=2" in _last_error()
    assert repack(4, 0, NULL, NULL, NULL, NULL, 16, 100, NULL) == 1 and "K_dim=100" in _last_error()
    gemm = cuda_ops._entry("ckbit_gemm")

    def call(k, dtype, absmax, codebook_len=4, M=1):
        return gemm(k, dtype, absmax, NULL, NULL, NULL, NULL, codebook_len, NULL, NULL, M, 16, 128, 128, NULL, 0, NULL)

    assert call(4, 2, 0) == 1 and "ckbit_gemm: dtype=2" in _last_error()
    assert call(4, 0, 2) == 1 and "absmax_format=2" in _last_error()
    assert call(9, 1, 1) == 1 and "k=9" in _last_error()
    assert call(2, 0, 0, codebook_len=5) == 1 and "codebook_len=5" in _last_error()
    assert call(4, 0, 0, M=0) == 1 and "M=0" in _last_error()


@needs_library
@pytest.mark.skipif(torch.cuda.is_available(), reason="provokes a launch failure by having no usable CUDA device")
def test_launch_failure_without_a_device_is_reported():
    """Valid arguments, no device: the launch fails and the entry returns 1 with the CUDA error as its message."""
    for name, call in _work_calls((4, 0, 0)).items():
        args = list(call)
        if name == "ckbit_dequantize_tiled":
            args[11], args[13] = 16, 128  # a non-empty region
        else:
            args[8] = 32  # n
        assert cuda_ops._entry(name)(*args) == 1
        message = _last_error()
        assert message.startswith(name + ": ") and len(message) > len(name) + 4, message


@needs_library
def test_test_hook_sets_the_sm_count_for_the_calling_thread_only():
    """ckbit_gemm_set_test_override's SM count stands in for the device's in the queries (sm_count <= 0) on the
    thread that set it, and -1 clears it; the plan it gives equals the plan asked for that count explicitly."""
    hook = cuda_ops._entry("ckbit_gemm_set_test_override")
    plan, sizing = cuda_ops._entry("ckbit_gemm_plan"), cuda_ops._entry("ckbit_gemm_workspace_bytes")
    shapes = [(M, 4096, 4096, k) for M in (1, 8, 64, 300) for k in (2, 4, 5)]
    for sms in (7, 132, 1000):
        assert len({plan(*s, sms) for s in shapes}) > 1, "the plan depends on the problem"
    own = [plan(*s, 0) for s in shapes]
    try:
        for sms in (7, 1000):
            hook(-1, sms)
            assert [plan(*s, 0) for s in shapes] == [plan(*s, sms) for s in shapes]
            assert [sizing(*s, 0) for s in shapes] == [sizing(*s, sms) for s in shapes]
            seen = []
            other = threading.Thread(target=lambda out=seen: out.extend(plan(*s, 0) for s in shapes))
            other.start()
            other.join()
            assert seen == own, "another thread plans for its own device"
    finally:
        hook(-1, -1)
    assert [plan(*s, 0) for s in shapes] == own


@pytest.mark.cuda
@pytest.mark.parametrize("k", (2, 3, 4, 5))
def test_cuda_gemm_every_format_and_the_hook(k):
    """ckbit_gemm for every (dtype, absmax format) at this k against the reference, plain and with the hook forcing
    each available config and an SM count; a config the device cannot run, forced, fails with the dispatcher's
    message, and the hook is cleared after the failed call (the next plain call plans on its own again)."""
    from test_kbit_gemm import run_case

    for dtype in (torch.float16, torch.bfloat16):
        for absmax_format in ("e4m4", "fp16"):
            run_case(9, 1000, 1312, k, dtype, absmax_format=absmax_format, bias=True)
    for config in range(cuda_ops.gemm_num_configs()):
        if cuda_ops.gemm_config_available(config):
            run_case(5, 1000, 1312, k, torch.float16, config=config, sm_count=13, path="fused")
    hook = cuda_ops._entry("ckbit_gemm_set_test_override")
    plain = cuda_ops.gemm_plan(5, 1000, 1312, k)
    with pytest.raises(RuntimeError, match="kbit_gemm: ckbit_gemm: config_override names a config"):
        run_case(5, 1000, 1312, k, torch.float16, config=1, path="fused")  # id 1 is retired
    assert cuda_ops.gemm_plan(5, 1000, 1312, k) == plain
    plan = cuda_ops._entry("ckbit_gemm_plan")
    assert plan(5, 1000, 1312, k, 0) == plain[0] + 256 * plain[1], "no override left behind"
    hook(-1, -1)
    buf = (ct.c_float * 8)()
    assert cuda_ops._entry("ckbit_gemm_cost_features")(0, 5, 1000, 1312, k, 0, buf) > 0

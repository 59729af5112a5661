"""The native CPU kernels of LinearKbit (csrc/cpu/kbit_cpu.cpp through bitsandbytes_kbit._cpu).

Reference: the pure-PyTorch dequantize (``dequantize_kbit_impl`` of the default backend) and a float64 product. The
fused kernel (few rows) and the blocked path (dequantize tiles + torch.mm) must stay within the float32
accumulation bound of that product; every instruction-set path (portable C++, AVX2, AVX-512, as far as this CPU
runs them) must give the same bits; the tile dequantizer must equal the reference bit for bit. Output buffers are
poisoned with NaN first, so a value the kernel forgets to write shows.
"""

import ctypes as ct

import pytest
import torch
from conftest import seeded

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit import _cpu
from bitsandbytes_kbit.backends.default.ops import dequantize_kbit_impl
from bitsandbytes_kbit.nn import LinearKbit
from bitsandbytes_kbit.nn.modules import padded_features

pytestmark = pytest.mark.skipif(
    not _cpu.AVAILABLE, reason="the CPU kernels' library is not present (built where a C++ compiler exists)"
)

ISAS = [isa for isa in range(len(_cpu.ISA_NAMES)) if isa <= _cpu.isa]
ABSMAX_FORMATS = {"e4m4": torch.uint8, "fp16": torch.float16, "fp32": torch.float32}


def quantized(k, N, K, absmax_format="e4m4", codebook=None, *seed):
    """A random weight [N, K] quantized flat (rows padded to a multiple of 32) and its dequantized reference."""
    g = seeded("cpu-kernel-weight", k, N, K, absmax_format, *seed)
    K_pad = padded_features(K)
    W = torch.nn.functional.pad(torch.randn(N, K, generator=g) * 0.05, (0, K_pad - K))
    packed, absmax, cb = F.quantize_kbit(W, k=k, codebook=codebook, absmax_format=absmax_format)
    W_ref = dequantize_kbit_impl(packed, absmax, cb, k, N * K_pad, torch.float32).view(N, K_pad)[:, :K]
    return packed, absmax, cb, W_ref


def assert_within_bound(y, x, W_ref, bias):
    """|y - y64| <= eps(y.dtype) |y64| + K eps32 (|x| @ |W|^T): float32 accumulation, one rounding to y's dtype."""
    x64, W64 = x.double(), W_ref.double()
    y64 = x64 @ W64.t()
    if bias is not None:
        y64 = y64 + bias.double()
    bound = torch.finfo(y.dtype).eps * y64.abs() + W_ref.shape[1] * torch.finfo(torch.float32).eps * (
        x64.abs() @ W64.abs().t()
    )
    err = (y.double() - y64).abs()
    assert bool((err <= bound + 1e-30).all()), f"max error {err.max():.3g}, max excess {(err - bound).max():.3g}"


def run_all_isas(monkeypatch, fn, *args, **kwargs):
    """fn(*args, **kwargs) under every ISA path this CPU runs; asserts they agree bit for bit, returns the result."""
    results = []
    for isa in ISAS:
        monkeypatch.setattr(_cpu, "isa", isa)
        results.append(fn(*args, **kwargs))
    for isa, r in zip(ISAS[1:], results[1:]):
        assert torch.equal(r, results[0]), f"{_cpu.ISA_NAMES[isa]} differs from {_cpu.ISA_NAMES[ISAS[0]]}"
    return results[0]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("M", [1, 2, 3, 5, _cpu.FUSED_MAX_ROWS, _cpu.FUSED_MAX_ROWS + 1, 40])  # fused, blocked
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_linear_matches_reference_on_every_isa(monkeypatch, k, dtype, M, bias):
    for N, K in ((40, 96), (17, 70), (5, 13)):
        packed, absmax, cb, W_ref = quantized(k, N, K)
        g = seeded("cpu-kernel-x", k, dtype, M, bias, N, K)
        x = torch.randn(M, K, generator=g).to(dtype)
        b = (torch.randn(N, generator=g) * 0.1).to(dtype) if bias else None
        y = run_all_isas(monkeypatch, _cpu.linear, x, packed, absmax, cb, k, N, K, padded_features(K), b)
        assert y.shape == (M, N) and y.dtype == dtype
        assert_within_bound(y, x, W_ref, b)


@pytest.mark.parametrize("absmax_format", list(ABSMAX_FORMATS))
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_absmax_formats_and_short_codebooks(monkeypatch, k, absmax_format):
    for levels in (2**k, 2**k - 1, 3):  # a codebook may hold fewer than 2^k levels
        codebook = torch.linspace(-1, 1, levels)
        packed, absmax, cb, W_ref = quantized(k, 24, 64, absmax_format, codebook, levels)
        assert absmax.dtype == ABSMAX_FORMATS[absmax_format] and cb.numel() == levels
        x = torch.randn(2, 3, 64, generator=seeded("short-codebook", k, absmax_format, levels))
        y = run_all_isas(monkeypatch, _cpu.linear, x, packed, absmax, cb, k, 24, 64, 64, None)
        assert y.shape == (2, 3, 24)
        assert_within_bound(y.reshape(6, 24), x.reshape(6, 64), W_ref, None)


@pytest.mark.parametrize("M", [1, 4, 7, _cpu.FUSED_MAX_ROWS])
def test_fused_kernel_writes_exactly_its_outputs(M):
    """Direct call into a NaN-poisoned output with a row stride wider than N: the M x N block is written (and
    equals the wrapper's result), the columns past N are left alone."""
    k, N, K = 4, 33, 50
    packed, absmax, cb, W_ref = quantized(k, N, K)
    x = torch.randn(M, K, generator=seeded("poison", M))
    y = torch.full((M, N + 7), float("nan"))
    rc = _cpu._lib().kbit_cpu_gemm(
        x.data_ptr(), K, 0, M, packed.data_ptr(), absmax.data_ptr(), 0, cb.data_ptr(), cb.numel(), k, N, K,
        padded_features(K), None, y.data_ptr(), N + 7, 0, torch.get_num_threads(), _cpu.isa,
    )  # fmt: skip
    assert rc == 0
    assert not bool(y[:, :N].isnan().any()) and bool(y[:, N:].isnan().all())
    assert torch.equal(y[:, :N], _cpu.linear(x, packed, absmax, cb, k, N, K, padded_features(K), None))
    assert_within_bound(y[:, :N], x, W_ref, None)


@pytest.mark.parametrize("absmax_format", list(ABSMAX_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_dequantize_rows_is_bit_exact(monkeypatch, k, dtype, absmax_format):
    N, K = 37, 96
    packed, absmax, cb, _ = quantized(k, N, K, absmax_format)
    ref = dequantize_kbit_impl(packed, absmax, cb, k, N * K, dtype).view(N, K)

    def tile(n0, n1):
        out = torch.full(((n1 - n0) * K + 9,), float("nan"), dtype=dtype)
        _cpu.dequantize_rows(packed, absmax, cb, k, K, n0, n1, out)
        assert bool(out[-9:].isnan().all())  # nothing past the requested rows
        return out[:-9].view(n1 - n0, K)

    for n0, n1 in ((0, N), (5, 6), (11, 30)):
        assert torch.equal(run_all_isas(monkeypatch, tile, n0, n1), ref[n0:n1])


@pytest.mark.parametrize("absmax_format", list(ABSMAX_FORMATS))
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_dequantize_kbit_op_on_cpu_is_bit_exact(monkeypatch, k, absmax_format):
    """functional.dequantize_kbit on CPU tensors runs the native kernel (the op's CPU kernel): the default backend's
    values bit for bit, any n (a tail block too), every output dtype, into a poisoned ``out`` as well."""
    g = seeded("dequantize-op", k, absmax_format)
    for n in (32 * 50, 32 * 50 - 7, 5):
        packed, absmax, cb = F.quantize_kbit(torch.randn(n, generator=g), k=k, absmax_format=absmax_format)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            ref = dequantize_kbit_impl(packed, absmax, cb, k, n, dtype)
            got = run_all_isas(monkeypatch, F.dequantize_kbit, packed, absmax, cb, k, n, dtype=dtype)
            assert torch.equal(got, ref)
            out = torch.full((n,), float("nan"), dtype=dtype)
            F.dequantize_kbit(packed, absmax, cb, k, n, dtype=dtype, out=out)
            assert torch.equal(out, ref)
    # A codebook without an entry for a stored index is refused, as by the default backend.
    packed, absmax, cb = F.quantize_kbit(torch.linspace(-1, 1, 64), k=k, codebook=torch.linspace(-1, 1, 2**k))
    with pytest.raises(ValueError, match="codebook has 2 entries"):
        F.dequantize_kbit(packed, absmax, cb[:2], k, 64, dtype=torch.float32)


def test_kernel_refuses_bad_arguments():
    packed, absmax, cb, _ = quantized(3, 4, 32)
    x = torch.randn(1, 32)
    with pytest.raises(RuntimeError, match="refused its arguments"):
        _cpu.linear(x, packed, absmax, cb, 6, 4, 32, 32, None)  # k = 6
    lib = _cpu._lib()
    y = torch.empty(1, 4)
    args = [x.data_ptr(), 32, 0, 1, packed.data_ptr(), absmax.data_ptr(), 0, cb.data_ptr(), cb.numel(), 3, 4]
    assert lib.kbit_cpu_gemm(*args, 32, 30, None, y.data_ptr(), 4, 0, 1, 0) == -1  # K_pad not a multiple of 32
    assert lib.kbit_cpu_gemm(*args, 40, 32, None, y.data_ptr(), 4, 0, 1, 0) == -1  # K > K_pad
    assert lib.kbit_cpu_dequantize(packed.data_ptr(), absmax.data_ptr(), 0, cb.data_ptr(), 9, 3, 0, 4, y.data_ptr(),
                                   0, 1, 0) == -1  # 9 levels for k = 3  # fmt: skip
    assert isinstance(lib.kbit_cpu_best_isa(), int) and ct.sizeof(ct.c_int64) == 8


@pytest.mark.parametrize("M", [1, 3, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_kbit_cpu_forward_keeps_no_float_weight(monkeypatch, dtype, M):
    """LinearKbit's CPU inference forward goes through the kernels: no call of the PyTorch dequantize (which would
    build the whole float weight), and the result is the kernel's, within the bound of the reference."""
    lin = torch.nn.Linear(70, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 70, generator=seeded("no-float-w", dtype, M)) * 0.05)
    module = LinearKbit.from_linear(lin, k=4)
    W_ref = module.dequantize(torch.float32)
    x = torch.randn(2, M, 70, generator=seeded("no-float-x", dtype, M)).to(dtype)

    def forbidden(*args, **kwargs):
        raise AssertionError("the CPU forward dequantized the whole weight")

    monkeypatch.setattr(F, "dequantize_kbit", forbidden)
    with torch.inference_mode():
        y = module(x)
    assert y.dtype == dtype and y.shape == (2, M, 48)
    assert_within_bound(y.reshape(-1, 48), x.reshape(-1, 70), W_ref, module.bias.to(dtype))
    # The autograd path (input that requires grad) runs the same kernels forward and matches.
    xg = x.detach().clone().requires_grad_()
    yg = module(xg)
    assert torch.equal(yg.detach(), y)


def test_without_the_library_linear_kbit_uses_the_pytorch_path(monkeypatch):
    lin = torch.nn.Linear(64, 16)
    module = LinearKbit.from_linear(lin, k=3)
    x = torch.randn(1, 64, generator=seeded("no-library"))
    with torch.no_grad():
        y_kernel = module(x)
        monkeypatch.setattr(_cpu, "AVAILABLE", False)
        y_torch = module(x)
    assert_within_bound(y_kernel, x, module.dequantize(torch.float32), module.bias.detach())
    assert_within_bound(y_torch, x, module.dequantize(torch.float32), module.bias.detach())


@pytest.mark.parametrize("M", [1, 5, 2 * _cpu.FUSED_MAX_ROWS])
def test_non_contiguous_inputs(M):
    """Strided x, bias and weight tensors give the result of their contiguous copies (the wrapper makes them
    contiguous and keeps them alive through the call)."""
    k, N, K = 3, 20, 45
    packed, absmax, cb, W_ref = quantized(k, N, K)
    g = seeded("strided", M)
    x = torch.randn(M, 2 * K, generator=g)[:, ::2]  # [M, K], stride 2
    bias = torch.randn(2 * N, generator=g)[::2]
    assert not x.is_contiguous() and not bias.is_contiguous()
    packed2 = torch.stack([packed, packed], 1)[:, 0]
    assert not packed2.is_contiguous()
    y = _cpu.linear(x, packed2, absmax, cb, k, N, K, padded_features(K), bias)
    assert torch.equal(y, _cpu.linear(x.contiguous(), packed, absmax, cb, k, N, K, padded_features(K), bias.clone()))
    assert_within_bound(y, x, W_ref, bias)


@pytest.mark.parametrize("tile_elements", [1, 3 * 96, 7 * 96 + 5])
def test_blocked_path_over_several_tiles(monkeypatch, tile_elements):
    """Many input rows with a weight tile smaller than the weight: weight rows split into tiles of 1, 3 and 7 (the
    last one partial) fill every output and stay within the bound (torch.mm may sum in another order per shape)."""
    k, N, K = 4, 40, 90
    packed, absmax, cb, W_ref = quantized(k, N, K)
    g = seeded("tiles", tile_elements)
    x = torch.randn(3, _cpu.FUSED_MAX_ROWS, K, generator=g).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    one_tile = _cpu.linear(x, packed, absmax, cb, k, N, K, 96, bias)
    monkeypatch.setattr(_cpu, "TILE_ELEMENTS", tile_elements)
    tiled = _cpu.linear(x, packed, absmax, cb, k, N, K, 96, bias)
    assert tiled.shape == (3, _cpu.FUSED_MAX_ROWS, N)
    torch.testing.assert_close(tiled, one_tile)
    assert_within_bound(tiled.reshape(-1, N), x.reshape(-1, K), W_ref, bias)

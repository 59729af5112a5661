"""Property-based tests of the flat format: the default backend (the reference the CUDA kernels match bit for bit)
against an independent NumPy model written from docs/format.md, on shapes, bit widths, codebooks (asymmetric,
short, with duplicate levels) and scales that hypothesis draws across the whole E4M4 range, fp16 and fp32.

The NumPy model:
  E4M4 byte c: e = c >> 4, m = c & 15; e == 0: m * 2^-14, else 2^(e - 11) * (1 + m / 16). A scale encodes to the
  nearest code (ties to the lower one); a nonzero scale never encodes to 0; past 31 it saturates to 0xFF.
  Per block of 32 (the tail zero-padded): s = decode(encode(max |x|)) (or max |x| rounded to fp16), index = the
  nearest codebook level to x / s (the lowest index on ties; x / s := 0 when s = 0), word b of the block = bit b
  of its 32 indices (element j in bit j). A value is codebook[index] * s in float32.
"""

import warnings

import numpy as np
import pytest
import torch

import bitsandbytes_kbit.functional as F

hypothesis = pytest.importorskip("hypothesis")
given, settings, st = hypothesis.given, hypothesis.settings, hypothesis.strategies


def e4m4_decode_np(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    e, m = c >> 4, c & 15
    sub = m.astype(np.float64) * 2.0**-14
    norm = np.ldexp(1.0 + m / 16.0, e - 11)
    return np.where(e == 0, sub, norm).astype(np.float32)


E4M4_TABLE = e4m4_decode_np(np.arange(256))


def e4m4_encode_np(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float32)
    dist = np.abs(a[:, None].astype(np.float64) - E4M4_TABLE[None, :].astype(np.float64))
    code = dist.argmin(axis=1)  # first minimum: the lower code on ties
    code = np.where(a > E4M4_TABLE[-1], 255, code)
    code = np.where((code == 0) & (a > 0), 1, code)
    return code.astype(np.uint8)


def quantize_np(x: np.ndarray, codebook: np.ndarray, k: int, absmax: str):
    n = x.size
    nb = -(-n // 32)
    blocks = np.zeros(nb * 32, dtype=np.float32)
    blocks[:n] = x.reshape(-1)
    blocks = blocks.reshape(nb, 32)
    amax = np.abs(blocks).max(axis=1)
    if absmax == "e4m4":
        stored = e4m4_encode_np(amax)
        scale = e4m4_decode_np(stored)
    else:
        stored = amax.astype(np.float16 if absmax == "fp16" else np.float32)
        scale = stored.astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    xn = np.where(scale[:, None] > 0, blocks / safe[:, None], np.float32(0)).astype(np.float32)
    idx = np.abs(xn[:, :, None] - codebook[None, None, :]).argmin(axis=2)
    idx.reshape(-1)[n:] = 0
    words = np.zeros((nb, k), dtype=np.uint64)
    for b in range(k):
        words[:, b] = (((idx >> b) & 1).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    packed = words.astype(np.uint32).view(np.int32).reshape(-1)
    values = (codebook[idx] * scale[:, None]).astype(np.float32).reshape(-1)[:n]
    return packed, stored, values


@st.composite
def cases(draw):
    k = draw(st.sampled_from([2, 3, 4, 5]))
    levels = draw(st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=2**k))
    codebook = np.sort(np.array(levels, dtype=np.float32))
    n = draw(st.integers(1, 200))
    absmax = draw(st.sampled_from(["e4m4", "fp16", "fp32"]))
    top = {"e4m4": 31.0, "fp16": 60000.0, "fp32": 1e30}[absmax]
    log_amax = draw(st.floats(-20.0, {"e4m4": 4.9, "fp16": 15.8, "fp32": 90.0}[absmax]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 2.0**log_amax / 3).astype(np.float32)
    x = np.clip(x, -top, top)
    if draw(st.booleans()):  # exact zeros, denormal-sized values and repeated values in the block
        x[rng.random(n) < 0.3] = 0.0
        x[rng.random(n) < 0.1] = np.float32(1e-41)
    return k, codebook, x, absmax


@settings(max_examples=150, deadline=None)
@given(cases())
def test_default_backend_matches_the_numpy_model(case):
    k, codebook, x, absmax = case
    packed, stored, values = quantize_np(x, codebook, k, absmax)
    cb = torch.from_numpy(codebook)
    got_packed, got_absmax = torch.ops.bitsandbytes.quantize_kbit(torch.from_numpy(x), cb, k, F.ABSMAX_FORMATS[absmax])
    np.testing.assert_array_equal(got_packed.numpy(), packed)
    np.testing.assert_array_equal(got_absmax.numpy(), stored)
    got_values = torch.ops.bitsandbytes.dequantize_kbit(got_packed, got_absmax, cb, k, x.size, torch.float32)
    np.testing.assert_array_equal(got_values.numpy(), values)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_absmax_rule_bound_holds_in_the_normal_range(case):
    """docs/format.md: |x - value| <= (max_gap / 2 + 1/16) * amax + 1e-6, max_gap the largest of the gaps between
    adjacent levels (levels in [-1, 1]), 2 (1 - max level) and 2 (1 + min level) (an asymmetric or short codebook
    pays for its distance to the ends), wherever the scale format is normal: amax >= 2^-10 with E4M4, >= 2^-14 with
    fp16, >= 2^-126 with fp32."""
    k, codebook, x, absmax = case
    _, _, values = quantize_np(x, codebook, k, absmax)
    blocks = np.zeros(-(-x.size // 32) * 32, dtype=np.float32)
    blocks[: x.size] = x
    amax = np.repeat(np.abs(blocks.reshape(-1, 32)).max(axis=1), 32)[: x.size].astype(np.float64)
    cb = codebook.astype(np.float64)
    gap = max(float(np.diff(cb).max()) if cb.size > 1 else 0.0, 2 * (1 - cb[-1]), 2 * (1 + cb[0]))
    normal = amax >= {"e4m4": 2.0**-10, "fp16": 2.0**-14, "fp32": 2.0**-126}[absmax]
    bound = (gap / 2 + 1 / 16) * amax + 1e-6
    err = np.abs(x.astype(np.float64) - values)
    assert np.all(err[normal] <= bound[normal])


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([2, 3, 4, 5]), st.integers(1, 40), st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31))
def test_repack_and_gemm_match_the_numpy_model(k, N, k_blocks, M, seed):
    """repack / unrepack is a bijection on the flat words, and the default backend's GEMM equals x @ W^T of the
    model's dequantized W (float64, within the float32 accumulation bound)."""
    rng = np.random.default_rng(seed)
    K = 32 * k_blocks
    W = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
    codebook = np.sort(rng.uniform(-1, 1, 2**k).astype(np.float32))
    packed, stored, values = quantize_np(W, codebook, k, "e4m4")
    cb = torch.from_numpy(codebook)
    B_packed, B_absmax = F.repack_kbit(torch.from_numpy(packed), torch.from_numpy(stored), k, N, K)
    flat, flat_absmax = F.unrepack_kbit(B_packed, B_absmax, k, N, K)
    np.testing.assert_array_equal(flat.numpy(), packed)
    np.testing.assert_array_equal(flat_absmax.numpy(), stored)
    A = (rng.standard_normal((M, K)) * 0.5).astype(np.float32)
    A16 = torch.from_numpy(A).to(torch.bfloat16)
    C = torch.ops.bitsandbytes.kbit_gemm(A16, B_packed, B_absmax, cb, k, N, K, None).double().numpy()
    W_model = values.reshape(N, K).astype(np.float64)
    ref = A16.double().numpy() @ W_model.T
    bound = 2**-8 * np.abs(ref) + K * 2**-23 * (np.abs(A16.double().numpy()) @ np.abs(W_model).T) + 1e-30
    assert np.all(np.abs(C - ref) <= bound)


@settings(max_examples=60, deadline=None)
@given(
    cases(),
    st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["absmax", "mse"]),
)
def test_non_finite_input_is_refused(case, bad, seed, method):
    """NaN or Inf anywhere in any tensor is refused, by either scale rule and by the op itself, as the format has no
    code for it."""
    k, codebook, x, absmax = case
    x = x.copy()
    x[np.random.default_rng(seed).integers(0, x.size)] = bad
    A, cb = torch.from_numpy(x), torch.from_numpy(codebook)
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize_kbit(A, k=k, codebook=cb, absmax_format=absmax, scale_method=method)
    with pytest.raises((ValueError, RuntimeError), match=r"NaN or Inf|finite"):
        torch.ops.bitsandbytes.quantize_kbit(A, cb, k, F.ABSMAX_FORMATS[absmax])


def unpack_np(packed: np.ndarray, k: int) -> np.ndarray:
    """int32 words [blocks * k] -> indices [blocks, 32] (bit j of word b = bit b of element j's index)."""
    words = packed.view(np.uint32).reshape(-1, k).astype(np.uint64)
    bits = (words[:, :, None] >> np.arange(32, dtype=np.uint64)[None, None, :]) & 1  # [blocks, k, 32]
    return (bits << np.arange(k, dtype=np.uint64)[None, :, None]).sum(axis=1).astype(np.int64)


def requantize_case(x, codebook, k, absmax, method, out_dtype=torch.float32):
    """(quantized once, then its dequantized values quantized again; which blocks keep their scale per the docs'
    condition; which blocks hold an element at a level of magnitude max |codebook|)."""
    cb = torch.from_numpy(codebook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tensors below the E4M4 normal range warn
        p1, a1, cb = F.quantize_kbit(torch.from_numpy(x), k=k, codebook=cb, absmax_format=absmax, scale_method=method)
        v = F.dequantize_kbit(p1, a1, cb, k, x.size, dtype=out_dtype)
        p2, a2, _ = F.quantize_kbit(v, k=k, codebook=cb, absmax_format=absmax, scale_method=method)
    nb = a1.numel()
    vb = np.zeros(nb * 32, dtype=np.float32)
    vb[: x.size] = v.float().numpy()
    vmax = np.abs(vb.reshape(nb, 32)).max(axis=1)
    top = np.float32(np.abs(codebook).max())
    target = vmax if method == "absmax" else (vmax / top if top > 0 else vmax)
    again = e4m4_encode_np(target) if absmax == "e4m4" else target.astype(a1.numpy().dtype)
    keeps = again == a1.numpy()
    idx = unpack_np(p1.numpy(), k)
    real = (np.arange(nb * 32) < x.size).reshape(nb, 32)
    at_top = ((np.abs(codebook[idx]) == top) & real).any(axis=1)
    return (p1.numpy().reshape(nb, k), a1.numpy()), (p2.numpy().reshape(nb, k), a2.numpy()), keeps, at_top


@settings(max_examples=150, deadline=None)
@given(cases(), st.sampled_from(["absmax", "mse"]))
def test_requantizing_dequantized_values_is_idempotent(case, method):
    """docs/format.md, Idempotence: quantize, dequantize to float32, quantize again with the same codebook, absmax
    format and rule. A block whose stored scale re-encodes to itself (from max |value| for the absmax rule, from
    max |value| / max |level| for the error-minimizing one) gets the same words and scale; that holds wherever an
    element sits at a level of magnitude max |codebook| when that is 1 (every built-in codebook), and for the
    error-minimizing rule with E4M4 or fp16 scales whatever it is; elsewhere the absmax rule's scale only shrinks. The one assumption: distinct levels more than a few
    float32 roundings apart (level * s / s must come back nearest to its level)."""
    k, codebook, x, absmax = case
    nonzero = np.abs(codebook[codebook != 0])
    hypothesis.assume(nonzero.size == 0 or nonzero.min() >= 2.0**-60)
    gaps, mags = np.diff(codebook), np.maximum(np.abs(codebook[1:]), np.abs(codebook[:-1]))
    hypothesis.assume(np.all((gaps == 0) | (gaps > 2.0**-20 * mags)))
    (w1, a1), (w2, a2), keeps, at_top = requantize_case(x, codebook, k, absmax, method)
    np.testing.assert_array_equal(w2[keeps], w1[keeps])
    np.testing.assert_array_equal(a2[keeps], a1[keeps])
    top = np.abs(codebook).max()
    if top == 1.0 or (method == "mse" and top > 0 and absmax != "fp32"):
        assert np.all(keeps[at_top]), "a block at the top level must keep its scale"
    if method == "absmax" and (~keeps).any():
        decode = e4m4_decode_np if absmax == "e4m4" else (lambda a: a.astype(np.float32))
        assert np.all(decode(a2[~keeps]) < decode(a1[~keeps])), "the absmax rule's scale only shrinks"

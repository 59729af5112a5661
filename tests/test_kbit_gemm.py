"""repack_kbit and the fused kbit_gemm.

Reference = the default backend on the same quantized weight: the flat words dequantized to
float32, multiplied in float32 (STYLE.md section 10), so the comparison measures kernel error
alone. Tolerance: the kernel rounds fp16/bf16 codebook x scale products (<= 2^-11 / 2^-8
relative each, random sign, so their effect on a K-long dot product shrinks as 1/sqrt(K)) and
the output (one rounding: 2^-11 / 2^-8 relative); relative Frobenius error <= 2e-3 (fp16) and
1e-2 (bf16) covers both with margin, while a wrong index, scale or row gives O(1)."""

import itertools
import math

import pytest
import torch
from conftest import requires_hopper, requires_two_gpus, seeded

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.backends.default import tiled_layout
from bitsandbytes_kbit.backends.default.ops import dequantize_tiled as dequantize_tiled_reference

KS = (2, 3, 4, 5)
GEMM_DTYPES = (torch.float16, torch.bfloat16)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
M_SWEEP = (1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 1000, 4096)
# (N, K_dim): the N = 1024, 4096, 14336 and N not a multiple of 128 (576, 1000); K_dim =
# 576, 4096, 14336. Every M runs on the first two; the larger ones at the M values that change
# the dispatch.
SHAPES_ALL_M = ((1000, 576), (576, 4096))
SHAPES_SOME_M = ((1024, 4096), (4096, 4096), (14336, 4096), (1000, 14336), (4096, 14336))
M_SOME = (1, 5, 16, 17, 64, 129, 1000)


def make_weight(N, K_dim, k, absmax_format="e4m4", device="cpu", *seed):
    g = seeded("W", N, K_dim, k, absmax_format, *seed)
    W = (torch.randn(N, K_dim, generator=g) * 0.02).to(device)
    packed, absmax, cb = F.quantize_kbit(W, k=k, absmax_format=absmax_format)
    return packed, absmax, cb


def reference(A, packed, absmax, cb, k, N, K_dim, bias=None):
    W = F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.float32).view(N, K_dim)
    C = A.reshape(-1, K_dim).float() @ W.t()
    if bias is not None:
        C += bias.float()
    return C.reshape(*A.shape[:-1], N)


def rel_err(C, ref):
    return float((C.float() - ref).norm() / ref.norm())


# ---------------------------------------------------------------- layout (CPU)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("N,K_dim", [(16, 128), (40, 96), (33, 160), (1, 32), (200, 544)])
@pytest.mark.parametrize("absmax_dtype", [torch.uint8, torch.float16])
def test_repack_round_trip_bit_exact(k, N, K_dim, absmax_dtype):
    g = seeded("rt", k, N, K_dim, absmax_dtype)
    nb = N * K_dim // 32
    packed = torch.randint(-(2**31), 2**31 - 1, (nb * k,), generator=g, dtype=torch.int64).to(torch.int32)
    absmax = torch.randint(0, 256, (nb,), generator=g, dtype=torch.int32).to(torch.uint8)
    if absmax_dtype == torch.float16:
        absmax = torch.rand(nb, generator=g).half()
    B_packed, B_absmax = F.repack_kbit(packed, absmax, k, N, K_dim)
    words, n_abs = tiled_layout.tiled_sizes(k, N, K_dim)
    assert B_packed.numel() == words and B_absmax.numel() == n_abs and B_absmax.dtype == absmax_dtype
    p2, a2 = F.unrepack_kbit(B_packed, B_absmax, k, N, K_dim)
    assert torch.equal(p2, packed) and torch.equal(a2.view(torch.uint8), absmax.view(torch.uint8))


def test_unrepack_rejects_wrong_sizes():
    words, n_abs = tiled_layout.tiled_sizes(3, 40, 96)
    packed, absmax = torch.zeros(words, dtype=torch.int32), torch.zeros(n_abs, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"B_packed has .* expected"):
        F.unrepack_kbit(packed[:-1], absmax, 3, 40, 96)
    with pytest.raises(ValueError, match="B_absmax"):
        F.unrepack_kbit(packed, absmax[:-1], 3, 40, 96)
    with pytest.raises(RuntimeError, match="k=6"):
        F.unrepack_kbit(packed, absmax, 6, 40, 96)


@pytest.mark.parametrize("k", KS)
def test_tiled_layout_fragment_order(k):
    """A lane's stream holds its 32 pair fields in MMA order (q = 4 (2 blk + s) + j): pair p = 2 s + (j >> 1) of row
    g + 8 (j & 1) is elements 8p + 2t, +1 of block blk, the k its register fragment slots stand for, so every config
    (ldmatrix, wgmma from shared memory) reads the tokens in their own order."""
    src_row, src_k, src_bit = tiled_layout._unit_bit_sources(k)
    lane_words, nv4, field_bits = 2 * k, (2 * k) // 4, 2 * k
    lo_bpe = 4 if k >= 4 else 2
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for lw in range(lane_words):
            off = (lw // 4) * 128 + lane * 4 + lw % 4 if lw < 4 * nv4 else nv4 * 128 + lane * 2 + (lw - 4 * nv4)
            for bit in range(32):
                q, x = divmod(32 * lw + bit, field_bits)
                blk, s, j = q // 8, (q // 4) % 2, q % 4
                p = 2 * s + (j >> 1)
                elem = x // lo_bpe if x < 2 * lo_bpe else x - 2 * lo_bpe
                assert int(src_row[off, bit]) == g + 8 * (j & 1), (lane, lw, bit)
                assert int(src_k[off, bit]) == 32 * blk + 8 * p + 2 * t + elem, (lane, lw, bit)
                assert int(src_bit[off, bit]) == (x % lo_bpe if x < 2 * lo_bpe else lo_bpe), (lane, lw, bit)


@pytest.mark.parametrize("k", KS)
def test_default_gemm_matches_reference(k):
    N, K_dim = 40, 96
    packed, absmax, cb = make_weight(N, K_dim, k)
    B_packed, B_absmax = F.repack_kbit(packed, absmax, k, N, K_dim)
    g = seeded("A", k)
    A = torch.randn(2, 3, K_dim, generator=g).half()
    bias = torch.randn(N, generator=g).half()
    C = F.kbit_gemm(A, B_packed, B_absmax, cb, k, N, K_dim, bias=bias)
    assert C.shape == (2, 3, N) and C.dtype == torch.float16
    ref = reference(A, packed, absmax, cb, k, N, K_dim, bias)
    assert torch.equal(C, ref.half())
    # identity activation returns the dequantized weight, transposed
    eye = torch.eye(K_dim, dtype=torch.bfloat16)
    W = F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.float32).view(N, K_dim)
    assert torch.equal(F.kbit_gemm(eye, B_packed, B_absmax, cb, k, N, K_dim), W.t().to(torch.bfloat16))
    out = torch.full((2, 3, N), float("nan"), dtype=torch.float16)
    assert F.kbit_gemm(A, B_packed, B_absmax, cb, k, N, K_dim, bias=bias, out=out) is out
    assert torch.equal(out, C)


def test_gemm_bad_input():
    N, K_dim, k = 40, 96, 4
    packed, absmax, cb = make_weight(N, K_dim, k)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    A = torch.randn(3, K_dim).half()
    with pytest.raises(RuntimeError, match=r"A has 95 features .* K_dim=96"):
        F.kbit_gemm(torch.randn(3, 95).half(), Bp, Ba, cb, k, N, K_dim)
    with pytest.raises(RuntimeError, match=r"A has dtype torch.float32"):
        F.kbit_gemm(A.float(), Bp, Ba, cb, k, N, K_dim)
    with pytest.raises(RuntimeError, match="not the flat quantize_kbit words"):
        F.kbit_gemm(A, packed, Ba, cb, k, N, K_dim)
    with pytest.raises(RuntimeError, match="B_packed has shape"):
        F.kbit_gemm(A, Bp, Ba, cb, k, 64, K_dim)
    with pytest.raises(RuntimeError, match="B_absmax has shape"):
        F.kbit_gemm(A, Bp, Ba[:, :10], cb, k, N, K_dim)
    with pytest.raises(RuntimeError, match="k=6 is not supported"):
        F.kbit_gemm(A, Bp, Ba, cb, 6, N, K_dim)
    with pytest.raises(RuntimeError, match="K_dim=100 is not a multiple of 32"):
        F.kbit_gemm(torch.randn(3, 100).half(), Bp, Ba, cb, k, N, 100)
    with pytest.raises(RuntimeError, match=r"bias has shape \(41,\)"):
        F.kbit_gemm(A, Bp, Ba, cb, k, N, K_dim, bias=torch.zeros(41).half())
    with pytest.raises(RuntimeError, match="one device"):
        F.kbit_gemm(A.to("meta"), Bp, Ba, cb, k, N, K_dim)
    with pytest.raises(RuntimeError, match=r"packed has 100 words; expected N\*K_dim/32\*k = 480"):
        F.repack_kbit(packed[:100], absmax, k, N, K_dim)
    with pytest.raises(
        RuntimeError, match=r"absmax has dtype torch.float32; expected torch.uint8 \(E4M4\) or torch.float16"
    ):
        F.repack_kbit(packed, absmax.float(), k, N, K_dim)
    with pytest.raises(RuntimeError, match="K_dim=80 is not a multiple of 32"):
        F.repack_kbit(packed, absmax, k, 48, 80)


def test_gemm_opcheck_and_compile():
    N, K_dim, k = 40, 96, 3
    packed, absmax, cb = make_weight(N, K_dim, k)
    torch.library.opcheck(torch.ops.bitsandbytes.repack_kbit.default, (packed, absmax, k, N, K_dim))
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    A = torch.randn(5, K_dim).half()
    bias = torch.randn(N).half()
    torch.library.opcheck(torch.ops.bitsandbytes.kbit_gemm.default, (A, Bp, Ba, cb, k, N, K_dim, bias))
    out = torch.empty(5, N, dtype=torch.float16)
    torch.library.opcheck(torch.ops.bitsandbytes.kbit_gemm.out, (A, Bp, Ba, cb, k, N, K_dim, bias), {"out": out})

    def f(x):
        return torch.relu(F.kbit_gemm(x, Bp, Ba, cb, k, N, K_dim, bias=bias)) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(A), f(A))


# ---------------------------------------------------------------- CUDA kernel vs reference


def run_case(M, N, K_dim, k, dtype, absmax_format="e4m4", bias=False, config=-1, sm_count=0, lead=(), path="auto"):
    from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda

    packed, absmax, cb = make_weight(N, K_dim, k, absmax_format, "cuda", M, dtype)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    g = seeded("A", M, N, K_dim, k, dtype)
    A = torch.randn(*lead, M, K_dim, generator=g).to("cuda", dtype)
    b = torch.randn(N, generator=g).to("cuda", dtype) if bias else None
    out = torch.full((*lead, M, N), float("nan"), dtype=dtype, device="cuda")  # poisoned
    kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, b, out, config=config, sm_count=sm_count, path=path)
    ref = reference(A, packed, absmax, cb, k, N, K_dim, b)
    assert bool(torch.isfinite(out).all()), "every element written"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative Frobenius error {err:.2e} > {TOL[dtype]:.0e}"
    return out


GEMM_CASES = [(M, N, K_dim) for N, K_dim in SHAPES_ALL_M for M in M_SWEEP] + [
    (M, N, K_dim) for N, K_dim in SHAPES_SOME_M for M in M_SOME
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("M,N,K_dim", GEMM_CASES, ids=[f"M{m}-N{n}-K{kd}" for m, n, kd in GEMM_CASES])
def test_cuda_gemm(M, N, K_dim, k, dtype):
    run_case(M, N, K_dim, k, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_every_config_and_sm_count(k):
    """Every compiled config through the override, and dispatch planned for SM counts from 1 to
    1000: more k-splits than work, one split, uneven splits; the answer must not change."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs

    for config in [-1] + [c for c in range(gemm_num_configs()) if gemm_config_available(c)]:
        for sm_count in (1, 7, 132, 1000):
            for M, N, K_dim in ((1, 1000, 14336), (3, 576, 576), (40, 4096, 4096), (300, 1000, 1024)):
                run_case(M, N, K_dim, k, torch.float16, config=config, sm_count=sm_count)


@pytest.mark.cuda
def test_cuda_gemm_cost_model():
    """The dispatcher's cost model (csrc/kbit_gemm.cu, cost_features and kbit_dispatch_coef.inc): features are finite
    and non-negative, waves whole; the model is calibrated for this build (different M get different configs, not
    the uncalibrated fallback everywhere), and every plan names a config this device runs."""
    import ctypes as ct

    from bitsandbytes_kbit.backends.cuda import ops as cuda_ops

    fn = cuda_ops._entry("ckbit_gemm_cost_features")
    buf = (ct.c_float * 8)()
    for config, (N, K_dim), M, k in itertools.product(
        range(-1, cuda_ops.gemm_num_configs()), ((4096, 4096), (1000, 576), (28672, 8192)), (1, 17, 300, 5000), KS
    ):
        n = fn(config, M, N, K_dim, k, 132, buf)
        assert n >= 4, (config, N, K_dim, M, k)
        values = list(buf[:n])
        assert all(math.isfinite(v) and v >= 0 for v in values), (config, N, K_dim, M, k, values)
        if config >= 0:
            assert values[4] == int(values[4]) and values[4] >= 1, (config, values)  # CTA waves
    plans = {cuda_ops.gemm_plan(M, 4096, 4096, 4, sm_count=132)[0] for M in (1, 8, 16, 32, 64, 128, 256)}
    assert len(plans) >= 3, f"one config for every M ({plans}): is kbit_dispatch_coef.inc calibrated?"
    for M, (N, K_dim), k in itertools.product((1, 16, 63, 300, 5000), ((4096, 4096), (256, 512)), KS):
        config, _ = cuda_ops.gemm_plan(M, N, K_dim, k, sm_count=132)
        assert cuda_ops.gemm_config_available(config), (M, N, K_dim, k, config)


@pytest.mark.cuda
def test_cuda_gemm_plan():
    """ops.gemm_plan (the dispatcher's config and k splits) names a config this device runs and 1..16 splits for
    LLM-sized shapes, M <= 256 and every k at 1 to 1000 SMs; and it is what runs: forcing the planned config gives
    the same bits as the dispatcher's own call (split-K sums in a fixed order)."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs, gemm_plan, kbit_gemm_cuda

    # checked against the reference too: the first 8 (narrow weights at M = 9..16, wider ones and short K at M = 5..8)
    shapes = (
        (1024, 4096),
        (2048, 4096),
        (4096, 14336),
        (14336, 4096),
        (8192, 1024),
        (512, 2048),
        (3072, 2048),
        (3072, 1024),
        (28672, 8192),
        (1000, 576),
    )
    for (N, K_dim), M, k, sms in itertools.product(shapes, (1, 4, 5, 8, 9, 16, 32, 64, 256), KS, (1, 66, 132, 1000)):
        config, splits = gemm_plan(M, N, K_dim, k, sm_count=sms)
        case = f"N={N} K={K_dim} M={M} k={k} sms={sms}: config {config}, {splits} splits"
        assert 0 <= config < gemm_num_configs() and gemm_config_available(config), case
        assert 1 <= splits <= 16, case
    for (N, K_dim), M, k in itertools.product(shapes[:8], (1, 4, 5, 8, 9, 16), (2, 5)):
        packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda", M)
        Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
        A = torch.randn(M, K_dim, generator=seeded("plan", N, K_dim, M, k)).to("cuda", torch.float16)
        config, _ = gemm_plan(M, N, K_dim, k, sm_count=132)
        outs = []
        for forced in (-1, config):
            out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
            kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, None, out, config=forced, sm_count=132, path="fused")
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (
            f"N={N} K={K_dim} M={M} k={k}: the plan (config {config}) is not what ran"
        )
        assert rel_err(outs[0], reference(A, packed, absmax, cb, k, N, K_dim)) <= TOL[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["fused", "staged"])
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_both_paths(path, k):
    """The fused kernel at large M and the staged path (dequantize + cuBLAS) at small M, forced, so
    each is checked outside the M range the dispatcher gives it; bias and bf16 included."""
    for M, N, K_dim in ((1, 1000, 576), (300, 4096, 1024), (1000, 576, 14336)):
        run_case(M, N, K_dim, k, torch.bfloat16 if M == 300 else torch.float16, bias=True, path=path)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "N,K_dim,budget_elems", [(1000, 576, 300 * 576), (600, 1312, 600 * 400)], ids=["rows", "cols"]
)
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=["fp16", "bf16"])
def test_cuda_staged_chunks(N, K_dim, budget_elems, dtype, monkeypatch):
    """The staged path cut into several chunks: along N for a wide weight (the last chunk not a
    multiple of 16 rows), along K for a deep one (accumulated in C; the last chunk not a multiple
    of 128) below STAGED_ROWS_MIN_M tokens and along N from there, with bias, at small and large M."""
    from bitsandbytes_kbit.backends.cuda import ops as cuda_ops

    monkeypatch.setattr(cuda_ops, "STAGING_BYTES", 2 * budget_elems)
    axis, chunks = cuda_ops.staging_chunks(N, K_dim)
    assert axis == ("n" if N >= K_dim else "k") and len(chunks) == 4
    assert chunks[-1][1] == (N if axis == "n" else K_dim) and all(b % 128 == 0 for b, _ in chunks)
    axis_big_m, rows = cuda_ops.staging_chunks(N, K_dim, 2, cuda_ops.STAGED_ROWS_MIN_M)
    assert axis_big_m == "n" and rows[-1][1] == N and len(rows) >= 4
    for M in (5, 300, cuda_ops.STAGED_ROWS_MIN_M):
        run_case(M, N, K_dim, 4, dtype, bias=True, path="staged")


@pytest.mark.cuda
@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", KS)
def test_cuda_dequantize_tiled_matches_default(k, dtype, absmax_format):
    """The tiled weight back in fp16/bf16 (the staged path and LinearKbit's backward use it) against
    the default backend: each element within one rounding of the reference (the kernel rounds
    codebook x 16 into the pair table, then the product)."""
    N, K_dim = 1000, 1312
    packed, absmax, cb = make_weight(N, K_dim, k, absmax_format, "cuda")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    W = torch.ops.bitsandbytes.dequantize_kbit_tiled(Bp, Ba, cb, k, N, K_dim, dtype)
    ref = dequantize_tiled_reference(Bp.cpu(), Ba.cpu(), cb.cpu(), k, N, K_dim)  # float32
    assert W.shape == (N, K_dim) and W.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(W.float().cpu(), ref, rtol=2 * eps, atol=float(ref.abs().max()) * 2 * eps)


@pytest.mark.cuda
@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16"])
@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=["fp16", "bf16"])
def test_cuda_gemm_bias_absmax_and_batched(absmax_format, dtype):
    for k in KS:
        run_case(7, 1000, 576, k, dtype, absmax_format=absmax_format, bias=True, lead=(2,))


@pytest.mark.cuda
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_every_config_bf16_fp16_absmax(k):
    """Every config (forced) with bf16 activations, fp16 absmax and bias: the scale conversion through
    fp32 and the 16-byte absmax copies in each kernel, at an M of two token tiles for configs 0 and 2
    and a partial tile for the wider ones."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs

    for config in [c for c in range(gemm_num_configs()) if gemm_config_available(c)]:
        for sm_count in (7, 132):
            run_case(
                9, 1000, 1312, k, torch.bfloat16, absmax_format="fp16", bias=True, config=config, sm_count=sm_count
            )


@pytest.mark.cuda
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_one_token_every_config(k):
    """M = 1, where the one-tile configs multiply each quantization block into its own token column of the MMA
    (k <= 4): every config (forced) with split-K planned for 7 and 132 SMs (config 8's short last k chunk
    included), fp16 and bf16, E4M4 and fp16 absmax, bias, a K_dim whose last k-step is partly past it, an A
    row that is not 16-byte aligned (the fallback copy), and the same bits from a second call."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs, kbit_gemm_cuda

    for config in [-1] + [c for c in range(gemm_num_configs()) if gemm_config_available(c)]:
        for sm_count in (7, 132):
            run_case(
                1, 1000, 1312, k, torch.bfloat16, absmax_format="fp16", bias=True, config=config, sm_count=sm_count
            )
            out = run_case(1, 1000, 1312, k, torch.float16, bias=config % 2 == 0, config=config, sm_count=sm_count)
            assert torch.equal(
                out, run_case(1, 1000, 1312, k, torch.float16, bias=config % 2 == 0, config=config, sm_count=sm_count)
            )
        N, K_dim = 1000, 4096
        packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda")
        Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
        A = torch.randn(1, K_dim + 1, generator=seeded("one-token", k, config)).to("cuda", torch.float16)[:, 1:]
        out = torch.full((1, N), float("nan"), dtype=torch.float16, device="cuda")
        kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, None, out, config=config, sm_count=132)
        assert rel_err(out, reference(A, packed, absmax, cb, k, N, K_dim)) <= TOL[torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_every_config_token_tiles(k):
    """Every config the device can run (the Hopper wgmma ones included), forced, at token counts
    around the 64- and 128-token tiles (partial tiles, several m tiles) and with split-K planned for
    7 and 132 SMs: fp16 and bf16, bias on odd M, an N that is not a multiple of the 128 / 256 rows
    of a CTA tile."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs

    for config in [c for c in range(gemm_num_configs()) if gemm_config_available(c)]:
        for M, sm_count in ((33, 132), (64, 7), (65, 132), (129, 7), (300, 132)):
            dtype = torch.bfloat16 if M % 2 else torch.float16
            run_case(M, 1000, 1312, k, dtype, bias=M % 2 == 1, config=config, sm_count=sm_count)


@pytest.mark.cuda
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_two_split_clusters(k):
    """Plans of exactly 2 k splits on the shared-A configs, which on sm_90 run as 2-CTA clusters: split 1 pushes its
    partial into split 0's shared memory (push_split_k), no workspace. Shapes and SM counts are searched for such
    plans at M = 1, 6 and 16 (one and two token tiles); fp16 and bf16, both absmax formats, bias, and the same bits
    from a second call. Then forced shared-A configs at M = 40 (several m tiles) planned for 16 SMs."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_plan

    found = set()
    for M, (N, K_dim), sms in itertools.product(
        (1, 6, 16), ((14336, 4096), (4096, 4096), (1000, 14336), (8192, 2048)), (132, 66, 33)
    ):
        config, splits = gemm_plan(M, N, K_dim, k, sm_count=sms)
        if splits != 2 or (config, M) in found:
            continue
        found.add((config, M))
        out = run_case(M, N, K_dim, k, torch.float16, bias=True, sm_count=sms)
        assert torch.equal(out, run_case(M, N, K_dim, k, torch.float16, bias=True, sm_count=sms))
        run_case(M, N, K_dim, k, torch.bfloat16, absmax_format="fp16", sm_count=sms)
    assert {M for _, M in found} == {1, 6, 16}, f"2-split plans found: {sorted(found)}"
    for config in (2, 3, 8, 9):  # shared-A configs every build has
        run_case(40, 1000, 4096, k, torch.float16, bias=True, config=config, sm_count=16)


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 16])
def test_cuda_gemm_dependent_chain(M):
    """Calls launched back to back where each one's A is the previous one's output, eagerly and from a CUDA
    graph, for every config (forced) with split-K planned for 132 SMs: under programmatic dependent launch
    (sm_90) a call's CTAs start while the previous call drains, and must read A (and write the shared split-K
    workspace) only once it is complete. The outputs are poisoned first, so an early read shows as NaN."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs, kbit_gemm_cuda

    N = K_dim = 2048
    layers, k = 6, 3
    g = seeded("chain", M)
    weights = []
    for i in range(layers):
        packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda", "chain", i)
        weights.append((packed, absmax, cb, *F.repack_kbit(packed, absmax, k, N, K_dim)))
    x0 = torch.randn(M, K_dim, generator=g).to("cuda", torch.float16)
    outs = [torch.empty(M, N, dtype=torch.float16, device="cuda") for _ in range(layers)]

    def chain(config):
        x = x0
        for (_, _, cb, Bp, Ba), out in zip(weights, outs):
            kbit_gemm_cuda(x, Bp, Ba, cb, k, N, K_dim, None, out, config=config, sm_count=132)
            x = out

    def check(config):
        x = x0
        for i, ((packed, absmax, cb, _, _), out) in enumerate(zip(weights, outs)):
            assert bool(torch.isfinite(out).all()), f"config {config}: layer {i} read its A before it was written"
            # the weights are N(0, 0.02^2): x grows by 0.02 sqrt(K) ~ 0.9 per layer, no overflow in 6
            err = rel_err(out, reference(x, packed, absmax, cb, k, N, K_dim))
            assert err <= TOL[torch.float16], f"config {config}: layer {i} error {err:.2e}"
            x = out

    for config in [-1] + [c for c in range(gemm_num_configs()) if gemm_config_available(c)]:
        for out in outs:
            out.fill_(float("nan"))
        chain(config)
        check(config)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(config)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(config)


@pytest.mark.cuda
def test_cuda_gemm_non_contiguous_stream_graph_and_repeat():
    N, K_dim, k = 1000, 4096, 4
    packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    # the CUDA repack equals the reference repack bit for bit
    Bp_ref, Ba_ref = F.repack_kbit(packed.cpu(), absmax.cpu(), k, N, K_dim)
    assert torch.equal(Bp.cpu(), Bp_ref) and torch.equal(Ba.cpu(), Ba_ref)
    g = seeded("nc")
    big = torch.randn(16, 2 * K_dim, generator=g).to("cuda", torch.float16)
    A = big[:, ::2]  # non-contiguous
    ref = reference(A, packed, absmax, cb, k, N, K_dim)
    assert rel_err(F.kbit_gemm(A, Bp, Ba, cb, k, N, K_dim), ref) <= TOL[torch.float16]
    At = big[:, :K_dim].t().contiguous().t()  # column-major view
    assert rel_err(F.kbit_gemm(At, Bp, Ba, cb, k, N, K_dim), reference(At, packed, absmax, cb, k, N, K_dim)) <= 2e-3
    # a second stream
    s = torch.cuda.Stream()
    Ac = A.contiguous()
    with torch.cuda.stream(s):
        C_s = F.kbit_gemm(Ac, Bp, Ba, cb, k, N, K_dim)
    s.synchronize()
    assert rel_err(C_s, ref) <= TOL[torch.float16]
    # CUDA graph: capture with out=, replay on new data
    out = torch.full((16, N), float("nan"), dtype=torch.float16, device="cuda")
    F.kbit_gemm(Ac, Bp, Ba, cb, k, N, K_dim, out=out)  # warm-up (workspace exists)
    static_A = Ac.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        F.kbit_gemm(static_A, Bp, Ba, cb, k, N, K_dim, out=out)
    A2 = torch.randn(16, K_dim, generator=g).to("cuda", torch.float16)
    static_A.copy_(A2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(A2, packed, absmax, cb, k, N, K_dim)) <= TOL[torch.float16]
    # the same inputs give the same bits
    assert torch.equal(F.kbit_gemm(Ac, Bp, Ba, cb, k, N, K_dim), F.kbit_gemm(Ac, Bp, Ba, cb, k, N, K_dim))


@pytest.mark.cuda
@pytest.mark.parametrize("N,K_dim", [(1024, 2560), (4224, 640)])
def test_cuda_staged_path_in_a_cuda_graph(N, K_dim, monkeypatch):
    """The staged path (dequantize + cuBLAS) captured in a CUDA graph takes its scratch from the graph's pool: replayed
    on new tokens it matches the reference (chunks of 1 MiB: a deep weight cut into k chunks, a wide one into rows),
    and an eager call of another weight between replays (the cached eager scratch reused) does not disturb it."""
    from bitsandbytes_kbit.backends.cuda import ops as cuda_ops
    from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda

    monkeypatch.setattr(cuda_ops, "STAGING_BYTES", 1 << 20)

    k, M = 4, 384
    packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    g = seeded("staged-graph", N, K_dim)
    static_A = torch.randn(M, K_dim, generator=g).to("cuda", torch.float16)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch's graph docs ask (cuBLAS state for capture)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kbit_gemm_cuda(static_A, Bp, Ba, cb, k, N, K_dim, None, out, path="staged")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kbit_gemm_cuda(static_A, Bp, Ba, cb, k, N, K_dim, None, out, path="staged")
    for step in range(2):
        A2 = torch.randn(M, K_dim, generator=g).to("cuda", torch.float16)
        static_A.copy_(A2)
        out.fill_(float("nan"))
        graph.replay()
        other = run_case(M, 2 * N, K_dim, k, torch.float16, path="staged")  # eager, between replays
        torch.cuda.synchronize()
        assert bool(torch.isfinite(other).all())
        assert rel_err(out, reference(A2, packed, absmax, cb, k, N, K_dim)) <= TOL[torch.float16], f"replay {step}"


WS_CONFIGS = (7, 14)  # the warp-specialised configs: 256- and 128-token tiles


@pytest.mark.cuda
@requires_hopper
def test_cuda_gemm_warp_specialised_large_m_and_graph():
    """Configs 7 and 14 (Hopper, sm_90a build): M beyond the dispatcher's range (10 or 19 token tiles, a partial last
    one) in one launch, k = 3 and 5, narrow and wide weights; the dispatcher's own choice (fused or staged) at 3000
    tokens; and config 7 at 512 tokens captured in a CUDA graph with out= and replayed on new data."""
    for ws in WS_CONFIGS:
        run_case(2400, 1000, 14336, 3, torch.float16, bias=True, config=ws)
        run_case(2400, 1000, 14336, 5, torch.bfloat16, config=ws)
        run_case(2400, 4200, 14336, 5, torch.float16, bias=True, config=ws)
    run_case(3000, 14336, 4096, 3, torch.float16, bias=True)
    run_case(3000, 4096, 14336, 2, torch.bfloat16)
    run_case(3000, 14336, 4096, 5, torch.float16)
    N, K_dim, k, M = 14336, 1024, 4, 512
    packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    g = seeded("ws-graph")
    static_A = torch.randn(M, K_dim, generator=g).to("cuda", torch.float16)
    out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
    F.kbit_gemm(static_A, Bp, Ba, cb, k, N, K_dim, out=out)  # warm-up: the workspace grows outside capture
    assert rel_err(out, reference(static_A, packed, absmax, cb, k, N, K_dim)) <= TOL[torch.float16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        F.kbit_gemm(static_A, Bp, Ba, cb, k, N, K_dim, out=out)
    A2 = torch.randn(M, K_dim, generator=g).to("cuda", torch.float16)
    static_A.copy_(A2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(A2, packed, absmax, cb, k, N, K_dim)) <= TOL[torch.float16]


@pytest.mark.cuda
@requires_hopper
@pytest.mark.parametrize("ws", WS_CONFIGS)
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_warp_specialised_split_k(k, ws):
    """Configs 7 and 14 split along k where its tiles leave SMs idle: uneven splits (49 k-steps in 25 + 24), 80 tiles
    planned for 1000 SMs (4 splits of 28 k-steps), bias and bf16; the dispatcher's own choice (a deep weight at M =
    256) twice in a row gives the same bits (the tile counters reset themselves, the slots are summed in split
    order). Without k splits, a partial last wave runs its tiles as two half-k CTAs: 32 tiles on 13 SMs (the last 6
    split, 17 k-steps in 9 + 8), 80 tiles on 37 SMs (the last 6 split, 56 + 56). k = 5 on a wider weight too: 330 tiles
    planned for 1000 SMs (3 splits of 38, 38, 36), and on 140 SMs (the last 50 tiles split)."""
    run_case(300, 1000, 6272, k, torch.bfloat16, bias=True, config=ws)
    run_case(2400, 1000, 14336, k, torch.float16, config=ws, sm_count=1000)
    run_case(1000, 1000, 2080, k, torch.bfloat16, bias=True, config=ws, sm_count=13)
    run_case(2400, 1000, 14336, k, torch.float16, config=ws, sm_count=37)
    if k == 5:
        run_case(2400, 4200, 14336, k, torch.bfloat16, bias=True, config=ws, sm_count=1000)
        run_case(2400, 4200, 14336, k, torch.float16, config=ws, sm_count=140)
    out = run_case(256, 4096, 14336, k, torch.float16, bias=k % 2 == 0)
    assert torch.equal(out, run_case(256, 4096, 14336, k, torch.float16, bias=k % 2 == 0))


@pytest.mark.cuda
@requires_hopper
@pytest.mark.parametrize("ws", WS_CONFIGS)
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_warp_specialised_token_multicast(k, ws):
    """Configs 7 and 14 with the token multicast (the CTAs of two weight tiles of one m tile run as a cluster and share its
    tokens: launches without k splits, with an even number of weight tiles and of split tail tiles): a partial last
    weight tile (N = 1000: 8 tiles) and a last m tile whose second 128 rows all lie past M (M = 600), planned for 24
    SMs (24 tiles: no splits, no tail), for 13 (a last wave of 11: no tail split) and for 10 (the last 4 tiles split
    in k halves, each tile's two halves a cluster summing through shared memory, one of them with every token past M in
    its half: the last m tile's second 128 rows); k = 5 also on a wider weight (N = 4352, 34 tiles, 102 SMs). Bias,
    bf16, output poisoned; a second call gives the same bits. (Config 14's 128-token tiles: M = 560 leaves the last m
    tile's second 64 rows past M, M = 600 does not; M = 40 has one m tile, its second half past M.)"""
    for M in (600, 560) if ws == 14 else (600,):
        run_case(M, 1000, 1312, k, torch.float16, bias=True, config=ws, sm_count=24)
        out = run_case(M, 1000, 1312, k, torch.bfloat16, config=ws, sm_count=13)
        assert torch.equal(out, run_case(M, 1000, 1312, k, torch.bfloat16, config=ws, sm_count=13))
        out = run_case(M, 1000, 1312, k, torch.float16, bias=True, config=ws, sm_count=10)
        assert torch.equal(out, run_case(M, 1000, 1312, k, torch.float16, bias=True, config=ws, sm_count=10))
    run_case(40, 1000, 1312, k, torch.float16, bias=True, config=ws, sm_count=8)
    if k == 5:
        run_case(600, 4352, 1312, k, torch.float16, bias=True, config=ws, sm_count=102)


@pytest.mark.cuda
@requires_hopper
@pytest.mark.parametrize("ws", WS_CONFIGS)
@pytest.mark.parametrize("k", KS)
def test_cuda_gemm_warp_specialised_token_strides(k, ws):
    """Configs 7 and 14's tokens come from A itself through the tensor map: a padded row stride (lda = K + 32, read as it is),
    and views the op copies first (lda % 8 != 0; a base 2 bytes off 16), each against the reference, output
    poisoned."""
    from bitsandbytes_kbit.backends.cuda.ops import _entry, kbit_gemm_cuda

    # the workspace is sized the same for every k, so a cached workspace does not grow, and free what an earlier graph
    # captured, when a call of another k follows
    sizing = _entry("ckbit_gemm_workspace_bytes")
    for M_, N_, K_ in itertools.product((256, 1024, 2048), (4096, 14336), (4096, 14336)):
        sizes = {sizing(M_, N_, K_, kb, 132) for kb in KS}
        assert len(sizes) == 1, f"workspace size depends on k at M = {M_}, N = {N_}, K = {K_}: {sizes}"
    M, K_dim = 300, 1312
    for N, (pad, offset) in itertools.product((1000, 4200) if k == 5 else (1000,), ((32, 0), (4, 0), (8, 1))):
        packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda", M, torch.float16)
        Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
        g = seeded("ws-strides", k, N, pad, offset)
        big = torch.randn(M, K_dim + pad + offset, generator=g).to("cuda", torch.float16)
        A = big[:, offset : offset + K_dim]
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
        kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, None, out, config=ws)
        ref = reference(A, packed, absmax, cb, k, N, K_dim)
        assert bool(torch.isfinite(out).all()), f"every element written (N {N}, pad {pad}, offset {offset})"
        assert rel_err(out, ref) <= TOL[torch.float16], f"N {N}, pad {pad}, offset {offset}"


@pytest.mark.cuda
def test_cuda_gemm_opcheck_compile_and_errors():
    N, K_dim, k = 1000, 576, 5
    packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    A = torch.randn(9, K_dim, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.bitsandbytes.kbit_gemm.default, (A, Bp, Ba, cb, k, N, K_dim, bias))
    torch.library.opcheck(torch.ops.bitsandbytes.repack_kbit.default, (packed, absmax, k, N, K_dim))

    def f(x):
        return F.kbit_gemm(x, Bp, Ba, cb, k, N, K_dim, bias=bias).float().sum(-1)

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(A), f(A))
    with pytest.raises(RuntimeError, match="one device"):
        F.kbit_gemm(A.cpu(), Bp, Ba, cb, k, N, K_dim)
    with pytest.raises(RuntimeError, match=r"A has dtype torch.float32"):
        F.kbit_gemm(A.float(), Bp, Ba, cb, k, N, K_dim)
    # CPU tensors reach the default backend
    C_cpu = F.kbit_gemm(A.cpu(), Bp.cpu(), Ba.cpu(), cb.cpu(), k, N, K_dim)
    assert rel_err(F.kbit_gemm(A, Bp, Ba, cb, k, N, K_dim).cpu(), C_cpu.float()) <= 1e-2


@pytest.mark.cuda
@requires_two_gpus
def test_cuda_gemm_second_device():
    N, K_dim, k = 576, 576, 4
    packed, absmax, cb = make_weight(N, K_dim, k, "e4m4", "cuda:1")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    A = torch.randn(3, K_dim, device="cuda:1", dtype=torch.float16)
    C = F.kbit_gemm(A, Bp, Ba, cb, k, N, K_dim)
    assert C.device == A.device
    assert rel_err(C, reference(A, packed, absmax, cb, k, N, K_dim)) <= 2e-3

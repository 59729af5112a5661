"""CUDA, tensors past 32-bit indexing: quantize and dequantize of more than 2^31 elements, kbit_gemm with N * K_dim,
M * K_dim and M * N above 2^31. Each big call is checked against the same ops on slices below 2^31 elements (blocks
are independent, so a slice at a block edge quantizes to its share of the words) or against a float32 reference
computed in row slices, so memory stays bounded. The slice straddling element 2^31 is also checked against the CPU
backend.

Marked ``bigmem`` (select with ``-m bigmem``, leave out with ``-m "not bigmem"``); skipped with less than 40 GB of
free GPU memory. About a minute on an H200."""

import pytest
import torch
from conftest import cuda_ready

import bitsandbytes_kbit.functional as F

BIG = 2**31


def _free_gpu_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if cuda_ready() else 0


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.bigmem,
    pytest.mark.skipif(not cuda_ready() or _free_gpu_bytes() < 40e9, reason="needs a CUDA GPU with 40 GB free"),
]


def _randn(n: int, seed: int, dtype=torch.float16, scale: float = 1.0) -> torch.Tensor:
    """n normal values on the GPU, made in 2^28-element pieces (fp32 temporaries stay at 1 GiB)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    out = torch.empty(n, dtype=dtype, device="cuda")
    step = 2**28
    for s in range(0, n, step):
        e = min(n, s + step)
        out[s:e] = torch.randn(e - s, generator=g, device="cuda") * scale
    return out


def _rel_err_rows(C: torch.Tensor, ref_rows) -> float:
    """Relative Frobenius error of C [M, N] against a reference given as (row slice, float32 rows) pieces."""
    num = den = 0.0
    for rows, ref in ref_rows:
        num += float((C[rows].float() - ref).norm()) ** 2
        den += float(ref.norm()) ** 2
    return (num / den) ** 0.5


@pytest.mark.parametrize("scale_method", ["absmax", "mse"])
def test_bigmem_quantize_dequantize_above_2_31(scale_method):
    k = 3
    n = BIG + 5 * 32 + 7  # past 2^31, with a short tail block
    A = _randn(n, 1)
    packed, absmax, cb = F.quantize_kbit(A, k=k, scale_method=scale_method)
    nb = -(-n // 32)
    assert packed.numel() == nb * k and absmax.numel() == nb
    out = F.dequantize_kbit(packed, absmax, cb, k, n, dtype=torch.float16)
    assert out.numel() == n
    step = 2**28  # elements per slice, a multiple of 32
    for s in range(0, n, step):
        e = min(n, s + step)
        b0, b1 = s // 32, -(-e // 32)
        p_s, a_s, _ = F.quantize_kbit(A[s:e], k=k, codebook=cb, scale_method=scale_method)
        assert torch.equal(packed[b0 * k : b1 * k], p_s), f"packed words of elements {s}..{e}"
        assert torch.equal(absmax[b0:b1], a_s), f"absmax of elements {s}..{e}"
        ref = F.dequantize_kbit(p_s, a_s, cb, k, e - s, dtype=torch.float16)
        assert torch.equal(out[s:e], ref), f"dequantized elements {s}..{e}"
    # the CPU backend from 2^20 elements below 2^31 to the end (block-aligned start, the short tail block included):
    # the same words (the absmax rule) or, for the error-minimizing search, where float rounding may flip a near-tie
    # between two candidate scales, nearly all
    s0 = BIG - 2**20
    p_c, a_c, _ = F.quantize_kbit(A[s0:].cpu(), k=k, codebook=cb.cpu(), scale_method=scale_method)
    b0, b1 = s0 // 32, nb
    if scale_method == "absmax":
        assert torch.equal(packed[b0 * k : b1 * k].cpu(), p_c) and torch.equal(absmax[b0:b1].cpu(), a_c)
    else:
        assert float((absmax[b0:b1].cpu() != a_c).float().mean()) < 1e-3
    cpu_values = F.dequantize_kbit(packed[b0 * k : b1 * k].cpu(), absmax[b0:b1].cpu(), cb.cpu(), k, n - s0)
    assert torch.equal(out[s0:].cpu(), cpu_values)
    # the tail: its last 7 elements exist, nothing past n is written into a bigger out=
    big_out = torch.full((n + 64,), 7.0, dtype=torch.float16, device="cuda")
    F.dequantize_kbit(packed, absmax, cb, k, n, dtype=torch.float16, out=big_out[:n])
    assert torch.equal(big_out[:n], out) and bool((big_out[n:] == 7.0).all())


def _quantize_rows(W_rows, N, K_dim, k):
    """A weight [N, K_dim] of more elements than one call should make at once, quantized in row slices (K_dim is a
    multiple of 32, so the slices' flat words concatenate to the whole weight's)."""
    rows = max(1, 2**28 // K_dim)
    packed, absmax, cb = [], [], None
    for r in range(0, N, rows):
        W = W_rows(r, min(N, r + rows))
        p, a, cb = F.quantize_kbit(W, k=k, codebook=cb, scale_method="absmax")
        packed.append(p)
        absmax.append(a)
    return torch.cat(packed), torch.cat(absmax), cb, rows


def _weight_rows(K_dim, seed):
    def rows(r0, r1):
        g = torch.Generator(device="cuda")
        g.manual_seed(seed + r0)
        return (torch.randn(r1 - r0, K_dim, generator=g, device="cuda") * 0.02).half()

    return rows


def _configs():
    from bitsandbytes_kbit.backends.cuda.ops import gemm_config_available, gemm_num_configs

    return [-1] + [c for c in range(gemm_num_configs()) if gemm_config_available(c)]


def test_bigmem_gemm_n_times_k_above_2_31():
    """A weight of more than 2^31 elements (N = 2^17 + 24 rows, not a multiple of 128): repack, then the fused kernel
    at decode and prefill sizes (the dispatcher's choice, and every config forced at M = 9), and the staged path;
    the reference multiplies the dequantized weight in float32, slice by slice."""
    from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda

    k, K_dim = 4, 16384
    N = BIG // K_dim + 24
    assert N * K_dim > BIG
    packed, absmax, cb, _ = _quantize_rows(_weight_rows(K_dim, 10), N, K_dim, k)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    # units are row-major over 16-row tiles: the rows from r0 (a multiple of 16, before element 2^31) to the end,
    # repacked alone, are the whole weight's last units (partial last tile included)
    r0, k_steps = BIG // K_dim - 1024, K_dim // 128
    Bp_s, Ba_s = F.repack_kbit(packed[r0 * K_dim // 32 * k :], absmax[r0 * K_dim // 32 :], k, N - r0, K_dim)
    assert torch.equal(Bp[r0 // 16 * k_steps :], Bp_s) and torch.equal(Ba[r0 // 16 * k_steps :], Ba_s)
    del Bp_s, Ba_s
    g = torch.Generator(device="cuda").manual_seed(11)
    A = torch.randn(300, K_dim, generator=g, device="cuda").half()
    step = 8192
    ref = []  # float32 A @ W^T in row slices of W
    for r in range(0, N, step):
        r1 = min(N, r + step)
        b0, b1 = r * K_dim // 32, r1 * K_dim // 32
        W = F.dequantize_kbit(packed[b0 * k : b1 * k], absmax[b0:b1], cb, k, (r1 - r) * K_dim, dtype=torch.float32)
        W = W.view(r1 - r, K_dim)
        ref.append(A.float() @ W.t())
    ref = torch.cat(ref, dim=1)
    cases = [(M, -1, "auto") for M in (1, 17, 300)] + [(9, c, "fused") for c in _configs()] + [(300, -1, "staged")]
    for M, config, path in cases:
        out = torch.full((M, N), float("nan"), dtype=torch.float16, device="cuda")
        kbit_gemm_cuda(A[:M], Bp, Ba, cb, k, N, K_dim, None, out, config=config, path=path)
        assert bool(torch.isfinite(out).all()), f"M={M} config={config} {path}: every element written"
        err = float((out.float() - ref[:M]).norm() / ref[:M].norm())
        assert err <= 2e-3, f"M={M} config={config} {path}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "M,N,K_dim", [(BIG // 8192 + 17, 1000, 8192), (BIG // 8200 + 33, 8200, 256)], ids=["MK", "MN"]
)
def test_bigmem_gemm_tokens_above_2_31(M, N, K_dim):
    """M * K_dim > 2^31 (an A of more than 2^31 elements) and M * N > 2^31 (an output of more than 2^31 elements),
    through every config (forced; the 32-bit token offsets of config 6 reroute to config 5 there) and the staged
    path; reference in float32 row slices."""
    from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda

    k = 5
    g = torch.Generator(device="cuda").manual_seed(20)
    W = (torch.randn(N, K_dim, generator=g, device="cuda") * 0.02).half()
    packed, absmax, cb = F.quantize_kbit(W, k=k, scale_method="absmax")
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    Wf = F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.float32).view(N, K_dim)
    A = _randn(M * K_dim, 21, dtype=torch.bfloat16).view(M, K_dim)
    step = max(1, 2**27 // max(K_dim, N))
    slices = [slice(r, min(M, r + step)) for r in range(0, M, step)]
    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    for config, path in [(c, "fused") for c in _configs()] + [(-1, "staged"), (-1, "auto")]:
        out.fill_(float("nan"))
        kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, None, out, config=config, path=path)
        assert bool(torch.isfinite(out).all()), f"config={config} {path}: every element written"
        err = _rel_err_rows(out, ((s, A[s].float() @ Wf.t()) for s in slices))
        assert err <= 1e-2, f"config={config} {path}: relative error {err:.2e}"

"""CUDA: concurrent GEMMs on two streams and on two devices give the bits of serial calls, the steady-state CUDA
path of dequantize, repack and GEMM never syncs the host (quantize: exactly one sync, its documented value check),
and quantize under CUDA-graph capture fails with a clear message that leaves the capture valid."""

import warnings

import pytest
import torch
from conftest import requires_two_gpus, seeded

import bitsandbytes_kbit.functional as F

# (M, N, K_dim, k, dtype, path): split-K plans (one token on a deep weight, 17 tokens), a shared-A tile, the large-M
# fused kernel and the staged path (dequantize to a scratch + cuBLAS): every one keeps per-call state (workspace
# counters and partial sums, or the scratch) that two concurrent calls must not share.
# (M, N, K_dim, k, dtype, path, sm_count): sm_count 1000 plans many k splits (0: the device's own count)
CASES = [
    (1, 1000, 14336, 4, torch.float16, "auto", 0),
    (1, 1000, 14336, 3, torch.bfloat16, "fused", 1000),
    (17, 4096, 4096, 3, torch.bfloat16, "auto", 0),
    (5, 1000, 6272, 5, torch.float16, "fused", 1000),
    (300, 1000, 4096, 2, torch.bfloat16, "fused", 0),
    (300, 2048, 4096, 4, torch.float16, "staged", 0),
]


def _gemm_inputs(M, N, K_dim, k, dtype, device, tag):
    g = seeded("conc", M, N, K_dim, k, dtype, tag)
    W = torch.randn(N, K_dim, generator=g) * 0.02
    packed, absmax, cb = F.quantize_kbit(W.to(device), k=k)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    A = torch.randn(M, K_dim, generator=g).to(device, dtype)
    return A, Bp, Ba, cb


def _run(case, inputs, out):
    from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda

    _, N, K_dim, k, _, path, sms = case
    A, Bp, Ba, cb = inputs
    kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, None, out, sm_count=sms, path=path)


@pytest.mark.cuda
def test_concurrent_gemms_on_two_streams_equal_serial():
    """Each case runs 12 times on each of two streams at once (different weights and tokens per stream), and every
    output equals the serial result bit for bit."""
    from bitsandbytes_kbit.backends.cuda.ops import gemm_plan

    assert any(gemm_plan(M, N, K_dim, k, sm_count=s)[1] > 1 for M, N, K_dim, k, _, _, s in CASES), "a split-K case"
    reps = 12
    for case in CASES:
        M, N, K_dim, k, dtype = case[:5]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        inputs = [_gemm_inputs(M, N, K_dim, k, dtype, "cuda", s) for s in range(2)]
        torch.cuda.synchronize()  # made on the default stream, read on the side streams
        serial = []
        for s in range(2):
            out = torch.empty(M, N, dtype=dtype, device="cuda")
            with torch.cuda.stream(streams[s]):
                _run(case, inputs[s], out)  # also creates this stream's workspace and scratch
            streams[s].synchronize()
            serial.append(out)
        outs = [[torch.full((M, N), float("nan"), dtype=dtype, device="cuda") for _ in range(reps)] for _ in range(2)]
        torch.cuda.synchronize()
        for r in range(reps):  # interleaved launches: the two streams' kernels overlap on the GPU
            for s in range(2):
                with torch.cuda.stream(streams[s]):
                    _run(case, inputs[s], outs[s][r])
        torch.cuda.synchronize()
        for s in range(2):
            for r in range(reps):
                assert torch.equal(outs[s][r], serial[s]), f"{case}: stream {s}, repetition {r} differs from serial"


@pytest.mark.cuda
@requires_two_gpus
def test_concurrent_gemms_on_two_devices_equal_serial():
    reps = 8
    for case in CASES[:3]:
        M, N, K_dim, k, dtype = case[:5]
        inputs = [_gemm_inputs(M, N, K_dim, k, dtype, f"cuda:{d}", d) for d in range(2)]
        serial = []
        for d in range(2):
            out = torch.empty(M, N, dtype=dtype, device=f"cuda:{d}")
            _run(case, inputs[d], out)
            torch.cuda.synchronize(d)
            serial.append(out)
        outs = [[torch.empty(M, N, dtype=dtype, device=f"cuda:{d}") for _ in range(reps)] for d in range(2)]
        for r in range(reps):
            for d in range(2):
                with torch.cuda.device(d):
                    _run(case, inputs[d], outs[d][r])
        for d in range(2):
            torch.cuda.synchronize(d)
            for r in range(reps):
                assert torch.equal(outs[d][r], serial[d]), f"{case}: device {d}, repetition {r} differs from serial"


def _syncs(fn) -> int:
    """Host syncs torch reports while ``fn`` runs (sync debug mode 'warn': one warning per sync)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_no_host_sync_on_the_cuda_path(k):
    """Second calls (the first builds per-device tables): dequantize (flat and tiled, into out= too), repack and GEMM
    at decode and prefill sizes and on the staged path sync 0 times, quantize exactly once (max |A|, which checks NaN,
    Inf and the absmax range in one read) for both scale methods."""
    from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda

    N, K_dim = 1000, 4096
    g = seeded("sync", k)
    W = (torch.randn(N, K_dim, generator=g) * 0.02).cuda()
    A = {M: torch.randn(M, K_dim, generator=g).to("cuda", torch.float16) for M in (1, 17, 300)}
    state = {}

    def quantize(method):
        state["q"] = F.quantize_kbit(W, k=k, scale_method=method)

    def rest():
        packed, absmax, cb = state["q"]
        out = torch.empty(N * K_dim, dtype=torch.bfloat16, device="cuda")
        F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.float16)
        F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.bfloat16, out=out)
        Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
        torch.ops.bitsandbytes.dequantize_kbit_tiled(Bp, Ba, cb, k, N, K_dim, torch.float16)
        for x in A.values():
            F.kbit_gemm(x, Bp, Ba, cb, k, N, K_dim)
        C = torch.empty(300, N, dtype=torch.float16, device="cuda")
        kbit_gemm_cuda(A[300], Bp, Ba, cb, k, N, K_dim, None, C, path="staged")

    _syncs(lambda: None)  # the first use of torch's sync debug mode in a process is not counted against the ops
    for method in ("absmax", "mse"):
        for _ in range(2):  # warm-up: tables, workspace, scratch, and what the first calls in a process set up
            quantize(method)
            rest()
        assert _syncs(lambda m=method: quantize(m)) == 1, f"quantize_kbit(scale_method={method!r})"
        assert _syncs(rest) == 0, "dequantize / repack / GEMM synced the host"
    # the error-minimizing search with float scales (its candidate steps live on the device once copied)
    F.quantize_kbit(W, k=k, absmax_format="fp16")
    assert _syncs(lambda: F.quantize_kbit(W, k=k, absmax_format="fp16")) == 1, "quantize_kbit(absmax_format='fp16')"
    # 'error' mode as well: any sync raises
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rest()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_quantize_under_graph_capture_fails_clearly():
    """quantize checks its input on the host, which capture forbids: a RuntimeError that says so, raised before
    anything is enqueued, so the capture ends valid and the stream works afterwards; the k-bit forward (dequantize +
    GEMM) captures and replays."""
    k, N, K_dim = 4, 256, 512
    W = torch.randn(N, K_dim, generator=seeded("graph-q")).cuda() * 0.02
    packed, absmax, cb = F.quantize_kbit(W, k=k)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
    x = torch.randn(8, K_dim, device="cuda", dtype=torch.float16)
    y = torch.empty(8, N, device="cuda", dtype=torch.float16)
    w_out = torch.empty(N * K_dim, device="cuda", dtype=torch.float16)
    F.kbit_gemm(x, Bp, Ba, cb, k, N, K_dim, out=y)  # warm-up outside capture
    for method in ("mse", "absmax"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            with pytest.raises(RuntimeError, match="CUDA-graph capture.*Quantize before capturing"):
                F.quantize_kbit(W, k=k, scale_method=method)
            with pytest.raises(RuntimeError, match="CUDA-graph capture"):
                torch.ops.bitsandbytes.quantize_kbit(W.half(), cb, k, torch.uint8)
            F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.float16, out=w_out)
            F.kbit_gemm(x, Bp, Ba, cb, k, N, K_dim, out=y)
        y.fill_(float("nan"))
        w_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = F.dequantize_kbit(packed, absmax, cb, k, N * K_dim, dtype=torch.float32)
        assert torch.equal(w_out.float(), ref.half().float())
        C = x.float() @ ref.view(N, K_dim).t()
        assert float((y.float() - C).norm() / C.norm()) < 2e-3
        # the stream is healthy: an eager quantize afterwards gives the pre-capture result
        p2, a2, _ = F.quantize_kbit(W, k=k, scale_method=method)
        q_ref = F.quantize_kbit(W, k=k, scale_method=method)
        assert torch.equal(p2, q_ref[0]) and torch.equal(a2, q_ref[1])

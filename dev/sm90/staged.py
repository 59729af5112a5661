"""Development check of the staged large-M path: tiled -> fp16 chunk (L2-sized) + cuBLAS per chunk."""
import ctypes as ct, sys, os
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from common import bench, make

lib = ct.CDLL(os.path.join(os.path.dirname(__file__), "..", "bin", "libsm90.so"))
S = lambda: ct.c_void_p(torch.cuda.current_stream().cuda_stream)
P = lambda t: ct.c_void_p(t.data_ptr())

def deq(Bp, Ba, cb, k, N, K, n0, n1, out, absname="u8abs"):
    dt = {torch.float16: "fp16", torch.bfloat16: "bf16"}[out.dtype]
    err = getattr(lib, f"deq_tiled_{dt}_{absname}_k{k}")(P(Bp), P(Ba), P(cb), cb.numel(), P(out), N, K, n0, n1, S())
    assert err == 0

def staged(A, Bp, Ba, cb, k, N, K, C, scratch, chunk):
    for n0 in range(0, N, chunk):
        n1 = min(N, n0 + chunk)
        w = scratch[: (n1 - n0) * K].view(n1 - n0, K)
        deq(Bp, Ba, cb, k, N, K, n0, n1, w)
        torch.mm(A, w.t(), out=C[:, n0:n1])

bad = 0
for (N, K, k, dt, fmt) in [(1000, 576, 4, torch.float16, "e4m4"), (136, 160, 3, torch.bfloat16, "e4m4"), (4096, 4096, 5, torch.float16, "fp16"), (576, 14336, 2, torch.float16, "e4m4")]:
    Bp, Ba, cb, Wd = make(N, K, k, fmt)
    out = torch.full((N, K), float("nan"), dtype=dt, device="cuda")
    deq(Bp, Ba, cb, k, N, K, 0, N, out, "u8abs" if fmt == "e4m4" else "fp16abs")
    torch.cuda.synchronize()
    e = float((out.float() - Wd).norm() / Wd.norm())
    ok = bool(torch.isfinite(out).all()) and e < (1e-3 if dt == torch.float16 else 5e-3)
    bad += not ok
    print(f"deq N={N} K={K} k={k} {dt} {fmt}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
    A = torch.randn(300, K, device="cuda", dtype=dt)
    C = torch.full((300, N), float("nan"), dtype=dt, device="cuda")
    scratch = torch.empty(8 << 20, dtype=dt, device="cuda")
    if fmt == "e4m4":
        staged(A, Bp, Ba, cb, k, N, K, C, scratch, 256)
        ref = A.float() @ Wd.t()
        e = float((C.float() - ref).norm() / ref.norm())
        ok = bool(torch.isfinite(C).all()) and e < (2e-3 if dt == torch.float16 else 1e-2)
        bad += not ok
        print(f"  staged gemm rel err {e:.2e} {'ok' if ok else 'FAIL'}")
print("failures:", bad, flush=True)

print(f"{'N':>6} {'K':>6} {'M':>5} {'k':>2} {'cublas':>8} {'deq-all':>8} | staged us (x cublas) for chunk MiB 8 / 16 / 32 / all")
for (N, K) in [(14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672)]:
    k = 4
    Bp, Ba, cb, Wd = make(N, K, k)
    W16 = Wd.half()
    scratch = torch.empty(N * K, dtype=torch.half, device="cuda")
    t_deq = bench(lambda: deq(Bp, Ba, cb, k, N, K, 0, N, scratch[: N * K].view(N, K)))
    for M in (256, 512, 1024, 4096):
        A = torch.randn(M, K, device="cuda").half()
        C = torch.empty(M, N, device="cuda", dtype=torch.half)
        t_cb = bench(lambda: torch.nn.functional.linear(A, W16))
        cells = []
        for mib in (8, 16, 32, 0):
            chunk = N if mib == 0 else max(16, (mib << 20) // (2 * K) // 16 * 16)
            t = bench(lambda: staged(A, Bp, Ba, cb, k, N, K, C, scratch, chunk))
            cells.append(f"{t:7.1f} ({t_cb / t:.2f})")
        print(f"{N:>6} {K:>6} {M:>5} {k:>2} {t_cb:>8.1f} {t_deq:>8.1f} | " + " ".join(cells), flush=True)

"""Development check of the sm_90a kernel: correctness vs the reference and timing vs cuBLAS."""
import ctypes as ct, sys, os
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from common import bench, make

lib = ct.CDLL(os.path.join(os.path.dirname(__file__), "..", "bin", "libsm90.so"))

def run(A, Bp, Ba, cb, k, N, K, absname="u8abs", grid=0, out=None, bn=256):
    dt = {torch.float16: "fp16", torch.bfloat16: "bf16"}[A.dtype]
    fn = getattr(lib, f"sm90_gemm_{dt}_{absname}_k{k}")
    M = A.shape[0]
    C = out if out is not None else torch.full((M, N), float("nan"), dtype=A.dtype, device="cuda")
    err = fn(bn, ct.c_void_p(A.data_ptr()), ct.c_void_p(Bp.data_ptr()), ct.c_void_p(Ba.data_ptr()), ct.c_void_p(cb.data_ptr()),
             cb.numel(), None, ct.c_void_p(C.data_ptr()), M, N, K, A.stride(0), grid,
             ct.c_void_p(torch.cuda.current_stream().cuda_stream))
    assert err == 0, err
    return C

torch.manual_seed(0)
bad = 0
if os.environ.get("SKIP_CORRECT"): pass
for (M, N, K) in [] if os.environ.get('SKIP_CORRECT') else [(128, 128, 128), (1, 1000, 576), (300, 1000, 4096), (256, 576, 14336), (1000, 4096, 1024), (77, 136, 160)]:
    for k in (2, 3, 4, 5):
        for dt, fmt in ((torch.float16, "e4m4"), (torch.bfloat16, "e4m4"), (torch.float16, "fp16")):
            Bp, Ba, cb, Wd = make(N, K, k, fmt)
            A = torch.randn(M, K, device="cuda").to(dt)
            C = run(A, Bp, Ba, cb, k, N, K, "u8abs" if fmt == "e4m4" else "fp16abs", bn=128 if (k + M) % 2 else 256)
            torch.cuda.synchronize()
            ref = A.float() @ Wd.t()
            e = float((C.float() - ref).norm() / ref.norm())
            ok = torch.isfinite(C).all().item() and e < (2e-3 if dt == torch.float16 else 1e-2)
            bad += not ok
            if not ok or (k == 4 and fmt == "e4m4"):
                print(f"M={M} N={N} K={K} k={k} {dt} {fmt}: rel err {e:.2e} {'ok' if ok else 'FAIL'}", flush=True)
print("correctness failures:", bad, flush=True)

print("mode timing (us), BN=256: full / no-dequant / no-A / no-A+no-dequant / no-A+no-wgmma; cublas")
for (N, K) in [(14336, 4096)]:
    for k in (4,):
        Bp, Ba, cb, Wd = make(N, K, k)
        for M in (1024, 4096):
            A = torch.randn(M, K, device="cuda").half()
            out = torch.empty(M, N, device="cuda", dtype=torch.half)
            ts = [bench(lambda: run(A, Bp, Ba, cb, k, N, K, out=out, grid=g, bn=bn)) for bn in (256,) for g in (0, -1, -8, -9, -10)]
            W16 = Wd.half()
            tc = bench(lambda: torch.nn.functional.linear(A, W16))
            print(N, K, M, k, " / ".join(f"{t:.1f}" for t in ts), f"; {tc:.1f}", flush=True)

"""A small target for ncu: one kbit_gemm call per k on one shape (repack and quantize run first).

ncu --clock-control none -k regex:kbit_gemm python dev/ncu_target.py --shape 28672x8192 --m 1 --ks 2 4
"""

import argparse

import torch

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.backends.cuda.ops import kbit_gemm_cuda


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="28672x8192")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--configs", nargs="+", type=int, default=[-1], help="forced configs (-1: the dispatcher's)")
    args = ap.parse_args()
    N, K = (int(x) for x in args.shape.split("x"))
    W = (torch.randn(N, K, device="cuda") * 0.02).half()
    A = torch.randn(args.m, K, device="cuda").half()
    for k in args.ks:
        packed, absmax, cb = F.quantize_kbit(W, k=k)
        Bp, Ba = F.repack_kbit(packed, absmax, k, N, K)
        torch.cuda.synchronize()
        for config in args.configs:
            if config < 0:
                F.kbit_gemm(A, Bp, Ba, cb, k, N, K)
            else:
                kbit_gemm_cuda(
                    A, Bp, Ba, cb, k, N, K, None, torch.empty(args.m, N, dtype=A.dtype, device=A.device), config=config
                )
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()

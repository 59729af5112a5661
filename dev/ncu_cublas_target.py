"""A small ncu target: one cuBLAS fp16 F.linear call on one shape (the comparison for a kbit_gemm profile).

ncu --clock-control none -k regex:"nvjet|gemm|xmma|cutlass" --launch-count 1 python dev/ncu_cublas_target.py --shape 14336x4096 --m 1024
"""

import argparse

import torch
import torch.nn.functional as torch_F


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="14336x4096")
    ap.add_argument("--m", type=int, default=1024)
    args = ap.parse_args()
    N, K = (int(x) for x in args.shape.split("x"))
    W = (torch.randn(N, K, device="cuda") * 0.02).half()
    A = torch.randn(args.m, K, device="cuda").half()
    torch_F.linear(A, W)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

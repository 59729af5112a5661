"""Per-kernel device times of one kbit_gemm call (torch.profiler): which kernels a call launches and how long
each takes, next to cuBLAS fp16, weights rotated past the L2.

    python dev/probe_kernel_split.py --shapes 4096x14336 --ms 1024 --ks 4
"""

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_paths import kbit_vs_fp16_cases


def kernel_times(fn, iters):
    fn(0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(i)
        torch.cuda.synchronize()
    t = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t[e.name[:70]].append(e.device_time)
    return {n: (len(v) / iters, sorted(v)[len(v) // 2]) for n, v in t.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x14336", "14336x4096", "8192x8192"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1024])
    ap.add_argument("--ks", nargs="+", type=int, default=[4])
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for shape, M, k, paths in kbit_vs_fp16_cases(args.shapes, args.ks, args.ms):
        for name, (fn, _) in paths.items():
            for kn, (per_call, us) in kernel_times(fn, args.iters).items():
                print(f"{shape:>11s} M={M:5d} k={k} {name:5s} {per_call:4.1f}x {us:8.1f} us  {kn}")


if __name__ == "__main__":
    main()

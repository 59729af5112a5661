"""Dequantize bandwidth: 64M elements at k = 2..5 into fp16 (or --dtype), GB/s counting the
packed words and absmax read plus the output written, against a device-to-device copy and a
read + write kernel measured in the same run.

    python benchmarking/bench_dequantize.py [--elements 67108864] [--dtype fp16] [--json out.json]
"""

import argparse
import json
import sys

import torch
from timing import copy_bandwidth, gpu_info, median_us, read_write_bandwidth

import bitsandbytes_kbit.functional as F

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=64 * 2**20)
    parser.add_argument("--dtype", choices=DTYPES, default="fp16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dequantize: needs a CUDA GPU")
    dtype = DTYPES[args.dtype]
    n = args.elements
    info = gpu_info()
    copy_bps = copy_bandwidth()
    rw_bps = read_write_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(n, device="cuda", generator=g, dtype=torch.float16)
    out = torch.empty(n, dtype=dtype, device="cuda")
    rows = []
    for k in (2, 3, 4, 5):
        packed, absmax, cb = F.quantize_kbit(A, k=k)
        nbytes = packed.numel() * 4 + absmax.numel() + n * out.element_size()
        us = median_us(
            lambda i, p=packed, a=absmax, c=cb, kb=k: F.dequantize_kbit(p, a, c, kb, n, dtype=dtype, out=out), iters=50
        )
        bps = nbytes / (us * 1e-6)
        rows.append(
            {"k": k, "bytes": nbytes, "us": us, "GBps": bps / 1e9, "of_copy": bps / copy_bps, "of_rw": bps / rw_bps}
        )
    print(f"\ndequantize_kbit, {n / 2**20:.0f}M elements -> {args.dtype}, {info['gpu']} ({info['sm_count']} SMs)")
    print(f"copy_ {copy_bps / 1e9:.0f} GB/s, read+write kernel {rw_bps / 1e9:.0f} GB/s (bytes read + written)")
    print(f"{'k':>2} {'MB moved':>9} {'us':>8} {'GB/s':>7} {'% of copy':>9} {'% of r+w':>9}")
    for r in rows:
        print(
            f"{r['k']:>2} {r['bytes'] / 1e6:>9.1f} {r['us']:>8.1f} {r['GBps']:>7.0f} {100 * r['of_copy']:>8.1f}% {100 * r['of_rw']:>8.1f}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {**info, "copy_GBps": copy_bps / 1e9, "rw_GBps": rw_bps / 1e9, "dtype": args.dtype, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

"""Quantize a weight-shaped tensor at k = 2..5 and print error and size per k.

    python -m bitsandbytes_kbit.demo [--rows 4096] [--cols 4096] [--device cuda|cpu]

Runs on the GPU when one is there (CUDA kernels), else on the CPU (the default PyTorch backend,
slower). The tensor is Gaussian with a few heavy-tailed blocks, like an LLM linear weight.
"""

import argparse
import math
import time

import torch

from . import cextension
from .functional import create_codebook, dequantize_kbit, quantize_kbit


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="out_features of the weight (default 4096)")
    parser.add_argument("--cols", type=int, default=4096, help="in_features of the weight (default 4096)")
    default_device = "cuda" if torch.cuda.is_available() and cextension.is_available() else "cpu"
    parser.add_argument("--device", default=default_device, help=f"default: {default_device}")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(args.rows, args.cols, generator=g) * 0.02
    W *= torch.where(torch.rand(args.rows, 1, generator=g) < 0.01, 8.0, 1.0)  # a few outlier rows
    W = W.to(device=device, dtype=torch.float16)
    n = W.numel()
    fp16_bytes = 2 * n
    where = "CUDA kernels" if device.type == "cuda" else "default PyTorch backend on the CPU (slower than a GPU)"
    print(f"bitsandbytes-kbit demo: W [{args.rows} x {args.cols}] fp16 ({fp16_bytes / 2**20:.1f} MiB) on {where}")

    rows = []
    for codebook in ("nf", "uniform", "fp4"):
        for k in (2, 3, 4, 5):
            if codebook == "fp4" and k != 4:
                continue
            print(f"  quantizing k={k} codebook={codebook} ...", flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            packed, absmax, cb = quantize_kbit(W, k=k, codebook=create_codebook(codebook, k, device))
            W_hat = dequantize_kbit(packed, absmax, cb, k, n, dtype=torch.float16).view_as(W)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            size = packed.numel() * 4 + absmax.numel() * absmax.element_size()
            err = (W.float() - W_hat.float()).norm() / W.float().norm()
            rows.append((codebook, k, size, 8 * size / n, fp16_bytes / size, float(err), -20 * math.log10(float(err)), seconds))

    print()
    print(f"{'codebook':>8} {'k':>2} {'size MiB':>9} {'bits/w':>7} {'vs fp16':>8} {'rel err':>8} {'SQNR dB':>8} {'time s':>7}")
    for codebook, k, size, bits, ratio, err, sqnr, seconds in rows:
        print(
            f"{codebook:>8} {k:>2} {size / 2**20:>9.2f} {bits:>7.3f} {ratio:>7.2f}x {err:>8.4f} {sqnr:>8.2f} {seconds:>7.2f}"
        )
    print("\nbits/w counts the packed indices and the 1-byte E4M4 scale per 32 weights; rel err = |W - W_hat| / |W|.")


if __name__ == "__main__":
    main()

"""Shared pieces of the sm_90 development scripts (not shipped)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarking"))
import bitsandbytes_kbit.functional as F  # noqa: E402
from bitsandbytes_kbit.backends.default.tiled_layout import repack_kbit_reference  # noqa: E402
from timing import median_us  # noqa: E402  (the project's one timing helper)


def bench(fn, iters=30):
    return median_us(lambda i: fn(), warmup=3, iters=iters)


def make(N, K, k, fmt="e4m4"):
    W = torch.randn(N, K, device="cuda") * 0.02
    p, a, cb = F.quantize_kbit(W, k=k, absmax_format=fmt)
    Bp, Ba = repack_kbit_reference(p, a, k, N, K)
    Wd = F.dequantize_kbit(p, a, cb, k, N * K, torch.float32).view(N, K)
    return Bp.contiguous(), Ba.contiguous(), cb, Wd

"""Where the time of the staged (large-M) path goes: for chosen shapes, k and M, times cuBLAS fp16,
the staged path at several chunk sizes, and its two halves alone (the tiled dequantize of every
chunk; the cuBLAS calls on already-dequantized chunks), all in one run on the GPU machine.

    python dev/probe_staged.py --shapes 4096x14336 28672x8192 --ks 4 --ms 1024 --chunks-mib 8 16 64
"""

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as torch_F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))
from probe_paths import weight_copies
from timing import copies_to_defeat_l2, median_us_graph

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.backends.cuda import ops


def time_dequant_all(copies, cb, k, N, K, full) -> float:
    """Median us of dequantizing the whole tiled weight (rotated copies) into `full`."""

    def run(i):
        Bp, Ba = copies[i % len(copies)]
        ops._dequantize_tiled_block(Bp, Ba, cb, k, N, K, 0, N, 0, K, full)

    return median_us_graph(run, rotate=len(copies), iters=20)


def time_staged(As, copies, cb, k, N, K, out, ref, rot, mib) -> str:
    """The staged path with STAGING_BYTES = mib MiB: total, dequantize alone, cuBLAS alone (us)."""
    ops.STAGING_BYTES = mib << 20
    ops._scratch.clear()
    axis, chunks = ops.staging_chunks(N, K, 2, As[0].shape[0])
    na = len(As)

    def staged(i):
        Bp, Ba = copies[i % len(copies)]
        ops.kbit_gemm_cuda(As[i % na], Bp, Ba, cb, k, N, K, None, out, path="staged")

    t_all = median_us_graph(staged, rotate=rot, iters=20)
    staged(0)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    span = max(e - b for b, e in chunks)
    scratch = torch.empty(span * (K if axis == "n" else N), device="cuda", dtype=out.dtype)

    def chunk_view(c0, c1):
        return scratch[: (c1 - c0) * K].view(c1 - c0, K) if axis == "n" else scratch[: N * (c1 - c0)].view(N, c1 - c0)

    def deq_only(i):
        Bp, Ba = copies[i % len(copies)]
        for c0, c1 in chunks:
            n0, n1, k0, k1 = (c0, c1, 0, K) if axis == "n" else (0, N, c0, c1)
            ops._dequantize_tiled_block(Bp, Ba, cb, k, N, K, n0, n1, k0, k1, chunk_view(c0, c1))

    def mm_only(i):
        A = As[i % na]
        for j, (c0, c1) in enumerate(chunks):
            W = chunk_view(c0, c1)
            if axis == "n":
                torch.mm(A, W.t(), out=out[:, c0:c1])
            elif j == 0:
                torch.mm(A[:, c0:c1], W.t(), out=out)
            else:
                out.addmm_(A[:, c0:c1], W.t())

    t_deq = median_us_graph(deq_only, rotate=rot, iters=20)
    t_mm = median_us_graph(mm_only, rotate=rot, iters=20)
    return f"{mib}MiB x{len(chunks)}{axis}: {t_all:7.1f} deq {t_deq:6.1f} mm {t_mm:6.1f}" + (
        "" if err < 5e-3 else f" ERR {err:.1e}"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["4096x14336", "14336x4096", "28672x8192"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1024])
    ap.add_argument("--ks", nargs="+", type=int, default=[4])
    ap.add_argument("--chunks-mib", nargs="+", type=int, default=[8, 16, 32, 64])
    ap.add_argument("--axes", nargs="+", default=["auto"], help="cut W along n, k or auto (the rule)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the axes x chunk sizes, interleaved")
    args = ap.parse_args()
    dtype = torch.float16
    print(f"{torch.cuda.get_device_name()}  lib={os.environ.get('BNB_KBIT_LIBRARY', 'installed')}")
    print("times in us; deq = tiled dequantize of every chunk alone, mm = the cuBLAS calls alone")
    saved = ops.STAGING_BYTES
    rule = ops.staging_chunks
    for shape in args.shapes:
        N, K = (int(x) for x in shape.split("x"))
        W = (torch.randn(N, K, device="cuda") * 0.02).to(dtype)
        for k in args.ks:
            packed, absmax, cb, w_copies, copies = weight_copies(W, k)
            Bp, Ba = copies[0]
            t_deq_all = time_dequant_all(copies, cb, k, N, K, torch.empty(N, K, device="cuda", dtype=dtype))
            gbs = (Bp.numel() * 4 + Ba.numel() + N * K * 2) / t_deq_all / 1e3
            print(f"{shape:>11} k={k} dequantize whole W: {t_deq_all:7.1f} us ({gbs:.0f} GB/s read+write)")
            for M in args.ms:
                na = copies_to_defeat_l2(M * K * 2)
                As = [torch.randn(M, K, device="cuda").to(dtype) for _ in range(na)]
                out = torch.empty(M, N, device="cuda", dtype=dtype)
                ref = torch_F.linear(As[0], F.dequantize_kbit(packed, absmax, cb, k, N * K, dtype).view(N, K))
                rot = max(na, len(w_copies), len(copies))
                t16 = median_us_graph(
                    lambda i, As=As, Ws=w_copies, out=out: torch.mm(As[i % len(As)], Ws[i % len(Ws)].t(), out=out),
                    rotate=rot,
                    iters=20,
                )
                cells = [f"fp16 {t16:7.1f}"]
                for _ in range(args.rounds):
                    for axis in args.axes:
                        ops.staging_chunks = functools.partial(rule, axis=None if axis == "auto" else axis)
                        for mib in args.chunks_mib:
                            cells.append("| " + time_staged(As, copies, cb, k, N, K, out, ref, rot, mib))
                ops.staging_chunks = rule
                ops.STAGING_BYTES = saved
                ops._scratch.clear()
                print(f"{shape:>11} k={k} M={M:<5} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()

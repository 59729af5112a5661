"""Time every fused config (forced), the staged path and cuBLAS fp16 for chosen shapes and M on one
GPU run: the table the dispatcher thresholds in csrc/kbit_gemm.cu and backends/cuda/ops.py come from.

    python dev/probe_paths.py --shapes 14336x4096 4096x14336 --ms 8 16 32 128 256 --ks 4
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as torch_F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))
from timing import copies_to_defeat_l2, median_us_graph

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.backends.cuda.ops import gemm_num_configs, kbit_gemm_cuda


def time_path(As, copies, cb, k, N, K, out, ref, **kw) -> str:
    """Median us of one kbit_gemm_cuda path over rotated copies, and its error against ref."""

    def run(i):
        Bp, Ba = copies[i % len(copies)]
        kbit_gemm_cuda(As[i % len(As)], Bp, Ba, cb, k, N, K, None, out, **kw)

    try:
        t = median_us_graph(run, rotate=max(len(As), len(copies)), iters=20)
    except Exception as exc:  # noqa: BLE001  (a config the device cannot run is reported, not fatal)
        return f"fail:{type(exc).__name__}"
    run(0)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return f"{t:7.1f}" + ("" if err < 5e-3 else f"(ERR {err:.1e})")


def weight_copies(W, k):
    """The k-bit weight of W (quantized, repacked) and enough copies of the fp16 and tiled weights that a
    rotation over them defeats the L2: (packed, absmax, codebook, fp16 copies, [(B_packed, B_absmax)])."""
    N, K = W.shape
    w_copies = [W] + [W.clone() for _ in range(copies_to_defeat_l2(W.numel() * 2) - 1)]
    packed, absmax, cb = F.quantize_kbit(W, k=k)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K)
    n = copies_to_defeat_l2(Bp.numel() * 4 + Ba.numel())
    return packed, absmax, cb, w_copies, [(Bp, Ba)] + [(Bp.clone(), Ba.clone()) for _ in range(n - 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x14336", "8192x8192"])
    ap.add_argument("--ms", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--ks", nargs="+", type=int, default=[4])
    ap.add_argument("--configs", nargs="*", type=int, default=None)
    ap.add_argument("--staged", action="store_true")
    ap.add_argument(
        "--sm-counts",
        nargs="+",
        type=int,
        default=[],
        help="also time the dispatcher planning for these SM counts (other split-K choices)",
    )
    args = ap.parse_args()
    configs = args.configs if args.configs is not None else list(range(gemm_num_configs()))
    dtype = torch.float16
    print(f"{torch.cuda.get_device_name()}  lib={os.environ.get('BNB_KBIT_LIBRARY', 'installed')}")
    for shape in args.shapes:
        N, K = (int(x) for x in shape.split("x"))
        W = (torch.randn(N, K, device="cuda") * 0.02).to(dtype)
        for k in args.ks:
            packed, absmax, cb, w_copies, copies = weight_copies(W, k)
            for M in args.ms:
                na = copies_to_defeat_l2(M * K * 2)
                As = [torch.randn(M, K, device="cuda").to(dtype) for _ in range(na)]
                out = torch.empty(M, N, device="cuda", dtype=dtype)
                ref = torch_F.linear(As[0], F.dequantize_kbit(packed, absmax, cb, k, N * K, dtype).view(N, K))
                t16 = median_us_graph(
                    lambda i, As=As, Ws=w_copies: torch_F.linear(As[i % len(As)], Ws[i % len(Ws)]),
                    rotate=max(na, len(w_copies)),
                    iters=20,
                )
                cells = [f"fp16={t16:7.1f}"]
                variants = [(f"c{c}", {"config": c}) for c in configs] + [("auto", {})]
                variants += [(f"sm{s}", {"sm_count": s}) for s in args.sm_counts]
                if args.staged:
                    variants.append(("staged", {"path": "staged"}))
                for name, kw in variants:
                    cells.append(f"{name}=" + time_path(As, copies, cb, k, N, K, out, ref, **kw))
                print(f"{shape:>11} k={k} M={M:<5} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()

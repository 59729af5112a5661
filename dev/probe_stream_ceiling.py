"""What a pure stream of the same bytes reaches against the benchmark's bandwidth floor: for the M = 1 bytes of
a weight at k = 2..5, the median graph-replay time of an elementwise read + write (x + 1 into y, the kernel the
floor's bandwidth comes from) and of a read-only reduction (torch.sum, not a bandwidth-tuned read) over that
many bytes, inputs rotated past the L2, next to a one-element kernel (launch and drain only, 64 per graph).
With --cublas, also cuBLAS fp16 (`F.linear`) at M = 1 and 16 on an fp16 weight of the same bytes (N' x K,
N' = bytes / 2K rounded to 16): how far the vendor GEMM gets on a matrix of that size; with --kbit,
kbit_gemm itself at M = 1 and 16 on the shape, in the same interleaved rounds.
Prints each as a fraction of the floor.

    python dev/probe_stream_ceiling.py --shapes 14336x4096 28672x8192
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))
from timing import copies_to_defeat_l2, median_us_graphs_interleaved, read_write_bandwidth


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x14336", "28672x8192"])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 3, 4, 5])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cublas", action="store_true", help="also cuBLAS fp16 on a weight of the same bytes")
    ap.add_argument("--kbit", action="store_true", help="also kbit_gemm at M = 1 and 16 on the shape")
    args = ap.parse_args()
    bw = read_write_bandwidth()
    print(f"{torch.cuda.get_device_name()}  floor bandwidth {bw / 1e9:.0f} GB/s")
    tiny = torch.zeros(1, device="cuda")
    for shape in args.shapes:
        N, K = (int(x) for x in shape.split("x"))
        for k in args.ks:
            nbytes = int(N * K * (k / 8 + 1 / 32) + 2 * K + 2 * N)  # the benchmark's M = 1 bytes
            floor = nbytes / bw * 1e6
            n_rw = nbytes // 8  # fp32 elements: half the bytes read, half written
            n_r = nbytes // 4
            rot = copies_to_defeat_l2(nbytes)
            xs = [torch.rand(n_rw, device="cuda") for _ in range(rot)]
            ys = [torch.empty_like(x) for x in xs]
            rs = [torch.rand(n_r, device="cuda") for _ in range(rot)]
            outs = [torch.empty((), device="cuda") for _ in range(rot)]
            paths = {
                "read+write": (lambda i, xs=xs, ys=ys: torch.add(xs[i], 1.0, out=ys[i]), rot),
                "read (sum)": (lambda i, rs=rs, outs=outs: torch.sum(rs[i], dim=0, out=outs[i]), rot),
                "1 element": (lambda i: tiny.add_(1.0), 64),  # 64 launches per graph, as the others' rotations
            }
            path_floor = {}  # paths whose bytes differ from the k-bit M = 1 bytes: their own floor
            if args.cublas:
                n_fp16 = max(16, round(nbytes / (2 * K) / 16) * 16)
                rot_w = copies_to_defeat_l2(n_fp16 * K * 2)
                ws = [torch.randn(n_fp16, K, device="cuda", dtype=torch.float16) for _ in range(rot_w)]
                for m in (1, 16):
                    a = torch.randn(m, K, device="cuda", dtype=torch.float16)
                    name = f"cuBLAS {n_fp16}x{K} M={m}"
                    paths[name] = (lambda i, ws=ws, a=a: torch.nn.functional.linear(a, ws[i]), rot_w)
                    path_floor[name] = (n_fp16 * K * 2 + 2 * m * K + 2 * m * n_fp16) / bw * 1e6
            if args.kbit:
                import bitsandbytes_kbit.functional as F

                packed, absmax, cb = F.quantize_kbit(torch.randn(N, K, device="cuda", dtype=torch.float16), k=k)
                Bp, Ba = F.repack_kbit(packed, absmax, k, N, K)
                rot_q = copies_to_defeat_l2(Bp.numel() * Bp.element_size() + Ba.numel() * Ba.element_size())
                qs = [(Bp, Ba)] + [(Bp.clone(), Ba.clone()) for _ in range(rot_q - 1)]
                for m in (1, 16):
                    a = torch.randn(m, K, device="cuda", dtype=torch.float16)
                    name = f"kbit M={m}"
                    paths[name] = (
                        lambda i, qs=qs, a=a, cb=cb, k=k, N=N, K=K: F.kbit_gemm(a, *qs[i], cb, k, N, K),
                        rot_q,
                    )
                    path_floor[name] = (N * K * (k / 8 + 1 / 32) + 2 * m * K + 2 * m * N) / bw * 1e6
            t = median_us_graphs_interleaved(paths, rounds=args.rounds, iters=4)
            cells = "  ".join(
                f"{name} {us:6.1f} us ({path_floor.get(name, floor) / us:5.1%})" for name, us in t.items()
            )
            print(f"{shape:>11} k={k} {nbytes / 1e6:6.1f} MB floor {floor:6.1f} us | {cells}", flush=True)


if __name__ == "__main__":
    main()

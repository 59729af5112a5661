"""Time every fused config (forced), the staged path and cuBLAS fp16 for chosen shapes and M on one
GPU run: the table the dispatcher thresholds in csrc/kbit_gemm.cu and backends/cuda/ops.py come from.
The paths of one (shape, k, M) are timed in interleaved rounds (timing.median_us_graphs_interleaved).

    python dev/probe_paths.py --shapes 14336x4096 4096x14336 --ms 8 16 32 128 256 --ks 4
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as torch_F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))
from timing import copies_to_defeat_l2, median_us_graphs_interleaved

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.backends.cuda import ops as cuda_ops
from bitsandbytes_kbit.backends.cuda.ops import gemm_num_configs, kbit_gemm_cuda


def plan_text(M, N, K, k) -> str:
    """The dispatcher's (config, splits) for the fused path, where the library exports it."""
    try:
        config, splits = cuda_ops.gemm_plan(M, N, K, k)
    except AttributeError:  # an older library (BNB_KBIT_LIBRARY) without ckbit_gemm_plan
        return ""
    return f"  plan=c{config}/s{splits}"


PRODUCE_A = False  # --produce-a: an elementwise kernel writes A right before each call (as a norm would)


def kbit_path(As, copies, cb, k, N, K, out, **kw):
    """One kbit_gemm_cuda path over rotated copies: (fn(i), rotate) for median_us_graphs_interleaved."""

    def run(i):
        Bp, Ba = copies[i % len(copies)]
        if PRODUCE_A:
            As[i % len(As)].mul_(1.0)
        kbit_gemm_cuda(As[i % len(As)], Bp, Ba, cb, k, N, K, None, out, **kw)

    return run, max(len(As), len(copies))


def rel_error(run, out, ref) -> float:
    out.fill_(float("nan"))
    run(0)
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def weight_copies(W, k):
    """The k-bit weight of W (quantized, repacked) and enough copies of the fp16 and tiled weights that a
    rotation over them defeats the L2: (packed, absmax, codebook, fp16 copies, [(B_packed, B_absmax)])."""
    N, K = W.shape
    w_copies = [W] + [W.clone() for _ in range(copies_to_defeat_l2(W.numel() * 2) - 1)]
    packed, absmax, cb = F.quantize_kbit(W, k=k)
    Bp, Ba = F.repack_kbit(packed, absmax, k, N, K)
    n = copies_to_defeat_l2(Bp.numel() * 4 + Ba.numel())
    return packed, absmax, cb, w_copies, [(Bp, Ba)] + [(Bp.clone(), Ba.clone()) for _ in range(n - 1)]


def kbit_vs_fp16_cases(shapes, ks, ms):
    """For each "NxK" shape, k and M: (shape, M, k, {"kbit": (fn(i), rotate), "fp16": (fn(i), rotate)}), one call of
    kbit_gemm or cuBLAS fp16 on weight copy i (rotated past the L2) into one output."""
    for shape in shapes:
        N, K = (int(v) for v in shape.split("x"))
        W = (torch.randn(N, K, device="cuda") * 0.02).half()
        for k in ks:
            _, _, cb, w_copies, copies = weight_copies(W, k)
            for M in ms:
                A = torch.randn(M, K, device="cuda").half()
                out = torch.empty(M, N, dtype=A.dtype, device="cuda")

                def kbit(i, A=A, out=out, cb=cb, copies=copies, k=k, N=N, K=K):
                    F.kbit_gemm(A, *copies[i % len(copies)], cb, k, N, K, out=out)

                def fp16(i, A=A, out=out, w_copies=w_copies):
                    torch.matmul(A, w_copies[i % len(w_copies)].t(), out=out)

                yield shape, M, k, {"kbit": (kbit, len(copies)), "fp16": (fp16, len(w_copies))}


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
    ap.add_argument("--nf4", action="store_true", help="also time bitsandbytes NF4 (quantize_4bit + matmul_4bit)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (4 replays each) per path")
    ap.add_argument("--produce-a", action="store_true", help="an elementwise kernel writes A before every call")
    ap.add_argument(
        "--settle", type=int, default=0, help="untimed calls of a path before each of its rounds (timing.py; 0: none)"
    )
    args = ap.parse_args()
    global PRODUCE_A
    PRODUCE_A = args.produce_a
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
                paths = {
                    "fp16": (
                        lambda i, As=As, Ws=w_copies: torch_F.linear(
                            As[i % len(As)].mul_(1.0) if PRODUCE_A else As[i % len(As)], Ws[i % len(Ws)]
                        ),
                        max(na, len(w_copies)),
                    )
                }
                if args.nf4:
                    import bitsandbytes as bnb

                    nf4 = [bnb.functional.quantize_4bit(Wc, blocksize=64, quant_type="nf4") for Wc in w_copies]
                    paths["nf4"] = (
                        lambda i, As=As, nf4=nf4: bnb.matmul_4bit(
                            As[i % len(As)], nf4[i % len(nf4)][0].t(), quant_state=nf4[i % len(nf4)][1]
                        ),
                        max(na, len(nf4)),
                    )
                variants = [(f"c{c}", {"config": c}) for c in configs] + [("auto", {})]
                variants += [(f"sm{s}", {"sm_count": s}) for s in args.sm_counts]
                if args.staged:
                    variants.append(("staged", {"path": "staged"}))
                errors, failed = {}, {}
                for name, kw in variants:
                    run, rot = kbit_path(As, copies, cb, k, N, K, out, **kw)
                    try:  # a config the device cannot run is reported, not fatal
                        errors[name] = rel_error(run, out, ref)
                        paths[name] = (run, rot)
                    except Exception as exc:  # noqa: BLE001
                        failed[name] = f"fail:{type(exc).__name__}"
                        print(f"{name}: {exc}"[:300], file=sys.stderr)
                times = median_us_graphs_interleaved(paths, rounds=args.rounds, iters=4, settle_calls=args.settle)
                cells = []
                for name in ["fp16", "nf4"] + [v[0] for v in variants]:
                    if name in failed:
                        cells.append(f"{name}={failed[name]}")
                    elif name in times:
                        err = errors.get(name, 0.0)
                        cells.append(f"{name}={times[name]:7.1f}" + ("" if err < 5e-3 else f"(ERR {err:.1e})"))
                print(f"{shape:>11} k={k} M={M:<5} " + "  ".join(cells) + plan_text(M, N, K, k), flush=True)


if __name__ == "__main__":
    main()

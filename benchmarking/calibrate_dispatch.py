"""Calibrate the fused GEMM's dispatcher (csrc/kbit_gemm.cu, select_config) for a GPU.

The dispatcher predicts each config's time as a linear function of a few features of the problem under that
config's tiling (waves, the busiest SM's warp k-steps, weight bytes, split-K partial bytes, padded MMA work; the C
function ckbit_gemm_cost_features computes them) and runs the config with the least prediction. This script measures
and fits the coefficients:

    python calibrate_dispatch.py sweep --json sweep.json          # on the GPU: every config forced, model shapes
    python calibrate_dispatch.py fit --json sweep.json --out ../csrc/kbit_dispatch_coef.inc   # anywhere

    python calibrate_dispatch.py sweep --json new.json --configs 7,14 --min-m 24 --shapes-from old.json
    python calibrate_dispatch.py fit --json old.json --json new.json --merged merged.json --out ...
    # the mma.sync configs above 256 tokens on small weights, to extend where the model trusts them:
    python calibrate_dispatch.py sweep --json small.json --configs 2,3,4,8,9,10,11,12,13 --min-m 384 \
        --max-m-small 2048 --max-weight-elems 16000000 --shapes-from old.json

`sweep` times, for a spread of the model suite's (N, K) (benchmarking/model_shapes.py), each M of a grid and each k,
every config this GPU runs (forced through the test hook), the staged path (M >= 64) and cuBLAS fp16, with CUDA
graphs and weight copies rotated past the L2 (timing.py). `fit` solves, per config and k, non-negative least squares
on relative error, reports how far its picks are from the fastest measured config with each shape held out of the
fit (leave-one-shape-out: the regret on shapes the fit never saw), and writes the coefficient table. Configs that never
beat every other candidate by 3% on the sweep are left without coefficients, so the dispatcher never picks them. Then
rebuild the library. The table also records, per path, the largest M it was measured at: the dispatcher trusts a path
up to there (at any M where that is the sweep's largest). A k missing from the sweep takes the mean of its
neighbours' coefficients. A partial sweep
(--configs, --min-m, --shapes-from: re-measuring configs that changed, or a new one) is fitted together with the full
one it refines: for each cell (N, K, k, M), a later --json's times replace or add to the earlier ones path by path.
"""

from __future__ import annotations

import argparse
import collections
import ctypes as ct
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PER_WARP_CONFIGS = (0, 1)  # measured up to PER_WARP_MAX_M tokens
PER_WARP_MAX_M = 64
LARGE_M_CONFIGS = (6, 7, 14)  # the only fused configs measured above SPLIT_K_MAX_M
SPLIT_K_MAX_M = 256
STAGED_MIN_M = 64
WIN_MARGIN = 1.03
DEFAULT_MS = "1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256,384,512,1024,2048"


def sweep(args) -> None:
    import torch
    import torch.nn.functional as torch_F

    sys.path.insert(0, str(HERE))
    from bench_kbit_gemm import select_model_shapes
    from timing import copies_to_defeat_l2, gpu_info, median_us_graphs_interleaved

    from bitsandbytes_kbit import functional as F
    from bitsandbytes_kbit.backends.cuda import ops as cops

    ks = [int(x) for x in args.ks.split(",")]
    ms = [int(x) for x in args.ms.split(",")]
    part = tuple(int(x) for x in args.part.split("/")) if args.part else None
    shapes = select_model_shapes(sample=0 if part else args.sample, part=part)
    if args.shapes_from:  # the (N, K) of an earlier sweep, so that its cells can be refined
        old = {(r["N"], r["K"]) for r in json.loads(Path(args.shapes_from).read_text())["rows"]}
        shapes = {f"{N}x{K}": (N, K, None) for N, K in sorted(old)}
    ms = [m for m in ms if m >= args.min_m]
    bnb = None
    if args.nf4:
        import bitsandbytes as bnb
    configs = [c for c in range(cops.gemm_num_configs()) if cops.gemm_config_available(c)]
    if args.configs is not None:
        configs = [c for c in configs if c in {int(x) for x in args.configs.split(",") if x}]
    print(f"configs {configs}; {len(shapes)} shapes x {len(ms)} M x k {ks}", flush=True)
    dtype, rows, t0 = torch.float16, [], time.time()
    if args.max_weight_elems:
        shapes = {label: s for label, s in shapes.items() if s[0] * s[1] <= args.max_weight_elems}
    for label, (N, K, _) in shapes.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        W = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(dtype)
        fp16 = [W] + [W.clone() for _ in range(copies_to_defeat_l2(W.numel() * 2, max_copies=64) - 1)]
        for k in ks:
            packed, absmax, cb = F.quantize_kbit(W, k=k, scale_method="absmax")
            Bp, Ba = F.repack_kbit(packed, absmax, k, N, K)
            n = copies_to_defeat_l2(Bp.numel() * 4 + Ba.numel(), max_copies=200)
            copies = [(Bp, Ba)] + [(Bp.clone(), Ba.clone()) for _ in range(n - 1)]
            nf4 = []
            if bnb is not None and k == 4:
                q, state = bnb.functional.quantize_4bit(W, blocksize=64, quant_type="nf4")
                n4 = copies_to_defeat_l2(q.numel() + N * K // 16, max_copies=64)
                nf4 = [(q, state)] + [
                    bnb.functional.quantize_4bit(W, blocksize=64, quant_type="nf4") for _ in range(n4 - 1)
                ]
            for M in ms:
                if time.time() - t0 > args.budget_s:
                    break
                ac = copies_to_defeat_l2(M * K * 2, max_copies=64)
                As = [torch.randn(M, K, device="cuda", generator=g).to(dtype) for _ in range(ac)]
                out = torch.empty(M, N, device="cuda", dtype=dtype)

                def path(config=-1, which="fused", As=As, ac=ac, copies=copies, out=out, k=k, cb=cb, N=N, K=K):
                    def fn(i):
                        cops.kbit_gemm_cuda(
                            As[i % ac], *copies[i % len(copies)], cb, k, N, K, None, out, config=config, path=which
                        )

                    return fn, max(len(copies), ac)

                paths = {
                    "fp16": (
                        lambda i, As=As, ac=ac, W16=fp16: torch_F.linear(As[i % ac], W16[i % len(W16)]),
                        len(fp16),
                    )
                }
                if not args.configs:
                    paths["auto"] = path(which="auto")
                if nf4:
                    paths["nf4"] = (
                        lambda i, As=As, ac=ac, nf4=nf4: bnb.matmul_4bit(
                            As[i % ac], nf4[i % len(nf4)][0].t(), quant_state=nf4[i % len(nf4)][1]
                        ),
                        max(len(nf4), ac),
                    )
                if M >= STAGED_MIN_M and not args.configs:
                    paths["staged"] = path(which="staged")
                for c in configs:
                    if (c in PER_WARP_CONFIGS and M > PER_WARP_MAX_M) or (
                        c not in LARGE_M_CONFIGS and M > args.max_m_small
                    ):
                        continue
                    paths[f"c{c}"] = path(config=c)
                us = median_us_graphs_interleaved(paths, rounds=2, iters=3)
                rows.append({"N": N, "K": K, "k": k, "M": M, "plan": cops.gemm_plan(M, N, K, k), "us": us})
                best = min((v, name) for name, v in us.items() if name not in ("fp16", "nf4", "auto"))
                print(
                    f"{label[:30]:30} k{k} M={M:<5} cuBLAS {us['fp16']:8.1f} auto {us.get('auto', float('nan')):8.1f} "
                    f"best {best[1]} {best[0]:8.1f} us",
                    flush=True,
                )
            del copies
        Path(args.json).write_text(json.dumps({"gpu": gpu_info(), "rows": rows}))
    print(f"{len(rows)} cells in {time.time() - t0:.0f} s -> {args.json}")


def nnls(X: list[list[float]], y: list[float], iters: int = 500):
    """min ||X b - y|| with b >= 0 (Lawson-Hanson active set)."""
    import numpy as np

    X, y = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    n = X.shape[1]
    passive = np.zeros(n, dtype=bool)
    b = np.zeros(n)
    for _ in range(iters):
        w = X.T @ (y - X @ b)
        if passive.all() or w[~passive].max() <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(X[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                b = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(b[neg] / (b[neg] - z[neg]))
            b = b + alpha * (z - b)
            passive &= b > 1e-12
    return b


def c_float(v: float) -> str:
    """A C float literal (6 significant digits)."""
    text = f"{v:.6g}"
    return (text if any(c in text for c in ".e") else text + ".0") + "f"


def library(path: str | None):
    if path is None:
        from bitsandbytes_kbit.backends.cuda.ops import _entry

        return _entry("ckbit_gemm_cost_features")
    fn = ct.CDLL(path).ckbit_gemm_cost_features
    fn.argtypes = [ct.c_int] * 6 + [ct.POINTER(ct.c_float)]
    fn.restype = ct.c_int
    return fn


def fit(args) -> None:
    import numpy as np

    features_fn = library(args.library)
    cells_by_key, gpus, gpu_info = {}, set(), None
    for path in args.json:  # a later file's times replace or add to an earlier one's, path by path
        data = json.loads(Path(path).read_text())
        for r in data["rows"]:
            key = (r["N"], r["K"], r["k"], r["M"])
            if key in cells_by_key:
                cells_by_key[key]["us"].update(r["us"])
            else:
                cells_by_key[key] = {**r, "us": dict(r["us"])}
        gpus.add(f"{data['gpu']['gpu']} ({data['gpu']['sm_count']} SMs)")
        gpu_info = data["gpu"]
    rows = list(cells_by_key.values())
    if args.merged:
        Path(args.merged).write_text(
            json.dumps(
                {
                    "gpu": gpu_info,
                    "note": "merged by calibrate_dispatch.py fit from " + ", ".join(Path(p).name for p in args.json),
                    "rows": rows,
                }
            )
        )
    if len(gpus) != 1:
        sys.exit(f"calibrate_dispatch fit: --json files come from {sorted(gpus)}; fit one GPU at a time")
    gpu = gpus.pop()
    sms = int(gpu.split("(")[1].split()[0])
    buf = (ct.c_float * 8)()

    def features(name, M, N, K, k):
        n = features_fn(-1 if name == "staged" else int(name[1:]), M, N, K, k, sms, buf)
        return list(buf[:n])

    # which candidates ever win by WIN_MARGIN
    winners = collections.Counter()
    for r in rows:
        cands = sorted((v, n) for n, v in r["us"].items() if n not in ("fp16", "auto", "nf4"))
        if len(cands) > 1 and cands[1][0] >= WIN_MARGIN * cands[0][0]:
            winners[cands[0][1]] += 1
    names = sorted({n for r in rows for n in r["us"] if n not in ("fp16", "auto", "nf4")})
    kept = [n for n in names if winners[n] > 0]
    print(
        f"{gpu}: {len(rows)} cells; wins by {WIN_MARGIN:.2f}x: {dict(winners)}; never: "
        f"{[n for n in names if n not in kept]}"
    )
    cells = [(n, r["k"], r["N"], r["K"], r["M"], v) for r in rows for n, v in r["us"].items() if n in kept]

    def solve(train):
        groups = collections.defaultdict(lambda: ([], []))
        for n, k, N, K, M, v in train:
            X, y = groups[(n, k)]
            X.append([f / v for f in features(n, M, N, K, k)])  # relative error: each row divided by its time
            y.append(1.0)
        return {key: nnls(X, y) for key, (X, y) in groups.items()}

    def pick(coef, r):
        cands = [n for n in r["us"] if n in kept and (n, r["k"]) in coef]
        pred = {n: float(np.dot(coef[(n, r["k"])], features(n, r["M"], r["N"], r["K"], r["k"]))) for n in cands}
        return min(pred, key=pred.get)

    shapes = sorted({(r["N"], r["K"]) for r in rows})
    regret, before = [], []
    for hold in shapes:
        coef = solve([c for c in cells if (c[2], c[3]) != hold])
        for r in rows:
            if (r["N"], r["K"]) == hold:
                best = min(v for n, v in r["us"].items() if n not in ("fp16", "auto", "nf4"))
                regret.append(r["us"][pick(coef, r)] / best)
                if "auto" in r["us"]:
                    before.append(r["us"]["auto"] / best)

    def summary(values):
        values = sorted(values)
        geo = math.exp(sum(map(math.log, values)) / len(values))
        return f"geomean {geo:.3f}, p90 {values[int(0.9 * (len(values) - 1))]:.2f}, worst {values[-1]:.2f}"

    print(f"time over the fastest measured candidate, each shape held out of the fit: {summary(regret)}")
    print(f"the library's dispatcher when the sweep ran:                               {summary(before)}")
    coef = solve(cells)
    ks = sorted({k for *_, k in [(0, r["k"]) for r in rows]})
    table = {}
    for n in kept:
        for k in range(2, 6):
            if (n, k) in coef:
                table[(n, k)] = coef[(n, k)]
            else:  # a k the sweep skipped: the mean of the measured neighbours
                near = [coef[(n, j)] for j in (k - 1, k + 1) if (n, j) in coef]
                if near:
                    table[(n, k)] = sum(near) / len(near)
    n_features = len(features("staged", 1, 128, 128, 4))
    num_configs = max(int(n[1:]) for n in names if n != "staged") + 1

    def row(n, k):
        values = table.get((n, k))
        return "{" + ", ".join(c_float(v) for v in (values if values is not None else [0.0] * n_features)) + "}"

    lines = [
        f"// Generated by calibrate_dispatch.py fit from {len(rows)} measured cells on {gpu}, k {ks};",
        "// do not edit. [config][k - 2][feature] (kbit_gemm.cu, cost_features); all zeros: never picked.",
        f"static const float COST_COEF[{num_configs}][4][COST_FEATURES] = {{",
    ]
    for c in range(num_configs):
        lines.append("    {" + ", ".join(row(f"c{c}", k) for k in range(2, 6)) + "},")
    lines += ["};", "static const float STAGED_COEF[4][COST_FEATURES] = {"]
    lines.append("    " + ", ".join(row("staged", k) for k in range(2, 6)) + ",")
    lines.append("};")
    # where the model is trusted: up to the largest M each path was measured at; a path measured up to the sweep's
    # largest M is trusted at any M (COST_ANY_M)
    top_m = max(r["M"] for r in rows)
    max_m = {n: max(r["M"] for r in rows if n in r["us"]) for n in names}
    lines += [
        f"static const int COST_ANY_M = {top_m}; // the sweep's largest M",
        f"static const int COST_MAX_M[{num_configs}] = {{{', '.join(str(max_m.get(f'c{c}', 0)) for c in range(num_configs))}}};",
        f"static const int STAGED_MAX_M = {max_m.get('staged', 0)};",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}: rebuild the library to use it")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="measure every config on the GPU")
    s.add_argument("--json", required=True)
    s.add_argument("--sample", type=int, default=24, help="(N, K) shapes spread over the model suite")
    s.add_argument("--part", default=None, help="I/N: the I-th of N interleaved parts of the model suite instead")
    s.add_argument("--nf4", action="store_true", help="also time bitsandbytes NF4 (k = 4 rows)")
    s.add_argument("--ks", default="2,4,5")
    s.add_argument("--ms", default=DEFAULT_MS)
    s.add_argument("--budget-s", type=float, default=480, help="stop measuring after this many seconds")
    s.add_argument("--configs", default=None, help="only these fused configs (e.g. 7,14), without auto and staged")
    s.add_argument("--min-m", type=int, default=1, help="only M >= this")
    s.add_argument("--shapes-from", default=None, help="the (N, K) shapes of this earlier sweep JSON")
    s.add_argument(
        "--max-m-small",
        type=int,
        default=SPLIT_K_MAX_M,
        help="the mma.sync configs (all but 0, 1, 6, 7, 14) up to this M",
    )
    s.add_argument("--max-weight-elems", type=int, default=0, help="only shapes with N * K at most this (0: all)")
    f = sub.add_parser("fit", help="fit the coefficients and write the table")
    f.add_argument("--json", action="append", required=True, help="sweep results (repeatable, one GPU)")
    f.add_argument("--out", required=True, help="the table to write, e.g. ../csrc/kbit_dispatch_coef.inc")
    f.add_argument("--library", default=None, help="libbitsandbytes_kbit_cuda.so (default: the installed one)")
    f.add_argument("--merged", default=None, help="also write the merged cells of every --json here")
    args = parser.parse_args(argv)
    sweep(args) if args.cmd == "sweep" else fit(args)


if __name__ == "__main__":
    main()

"""kbit_gemm against cuBLAS fp16, bitsandbytes NF4 and the memory-bandwidth floor.

    python benchmarking/bench_kbit_gemm.py [--bf16] [--shapes L8B-q,L70B-down] [--ms 1,16,64]
        [--ks 2,3,4,5] [--json out.json] [--plot out.png]
    python benchmarking/bench_kbit_gemm.py --suite models [--family qwen2.5 --family phi] [--sample 10]
        [--m 1,16,256] [--k 4] [--dtype bf16] [--json out.json] [--plot out.png] [--dry-run]

--suite models: every distinct (N, K) of the model families in model_shapes.py (each tagged with its
models and roles), on the M grid MODELS_MS, with a shorter timing budget per cell (MODELS_TIMING) so that
about 10 shapes fit one 10-minute command; --family / --sample pick a part, and the runtime of each shape
is estimated (and printed) before the run. The summary gives, per (M range, k) and weight size (N*K >= 16M
or not), the worst cell and the geometric mean of the speedup over cuBLAS, k = 4 against NF4, and the
worst shapes. --dry-run runs the whole flow without a GPU on modelled times (to check the script).

For each shape (N, K) and M it times, in one run on one GPU:
  kbit k=2..5   bnb.functional.kbit_gemm on the repacked weight
  fp16          cuBLAS through F.linear (bf16 with --bf16)
  nf4           bitsandbytes' own 4-bit path: quantize_4bit(W, blocksize=64, quant_type="nf4") + matmul_4bit
  floor         bytes / bandwidth, bytes = N*K*(k/8 + 1/32) + 2*M*K + 2*M*N, bandwidth from a large
                read + write kernel measured in this run
Timing: CUDA-graph replay of one call per weight copy, weights (and small activations) rotated
over enough copies that a rotation touches > 3x the L2 size, median of many replays. The paths of one
(shape, M) are replayed in interleaved rounds, so clock drift over the run does not favour the first, and
in each round a path first runs untimed for 1500 calls (at most 0.3 s): at large M the GPU runs at its
power limit and its clock follows the power the running kernel draws, with a lag of 0.1-0.3 s, so each
path is timed at its own steady-state clock, not the one the path before it left (timing.py).
"""

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as torch_F
from model_shapes import distinct_shapes, families, model_shapes, shape_label
from timing import copies_to_defeat_l2, gpu_info, l2_bytes, median_us_graphs_interleaved, read_write_bandwidth

import bitsandbytes_kbit.functional as F

SHAPES = {
    "L8B-q": (4096, 4096),
    "L8B-kv": (1024, 4096),
    "L8B-gateup": (14336, 4096),
    "L8B-down": (4096, 14336),
    "L70B-q": (8192, 8192),
    "L70B-gateup": (28672, 8192),
    "L70B-down": (8192, 28672),
}
LARGE = ("L8B-gateup", "L8B-down", "L70B-q", "L70B-gateup", "L70B-down")
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
MAX_COPIES = 200
ROUNDS, ITERS_PER_ROUND = 4, 5  # 20 graph replays per path, interleaved with the other paths
SETTLE_CALLS = 1500  # before each round's replays, a path runs untimed for 1500 calls (at most 0.3 s)

MODELS_MS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)
# --suite models, per cell (shape, M): (rounds, replays per round, settle cap in s); fewer rounds at M >= 1024,
# where one call takes 0.1-2 ms and the settle before each round dominates the cell's time.
MODELS_TIMING = {"small_m": (3, 4, 0.1), "large_m": (2, 4, 0.1)}
BIG_NK = 16 * 2**20  # the split: weights with N*K >= 16M against smaller ones
M_RANGES = (("M<=16", lambda M: M <= 16), ("M=24..96", lambda M: 24 <= M <= 96), ("M>=128", lambda M: M >= 128))
# H200 model for the runtime estimate and --dry-run: DRAM bytes/s and dense fp16 FLOP/s reached by cuBLAS
EST_BW, EST_FLOPS, EST_LAUNCH_US = 4.0e12, 6.0e14, 6.0


def floor_us(N, K, M, k, bw):
    nbytes = N * K * (k / 8 + 1 / 32) + 2 * M * K + 2 * M * N
    return nbytes / bw * 1e6


def bench_shape(name, N, K, ms, ks, dtype, bw, bnb, timing=None):
    """timing: None for the named suite's budget, else MODELS_TIMING (per-cell rounds by M)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    W = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(dtype)
    results = {}

    # weights and their copies
    fp16_copies = [W] + [W.clone() for _ in range(copies_to_defeat_l2(W.numel() * 2) - 1)]
    kbit = {}
    for k in ks:
        packed, absmax, cb = F.quantize_kbit(W, k=k)
        Bp, Ba = F.repack_kbit(packed, absmax, k, N, K)
        del packed, absmax
        n = copies_to_defeat_l2(Bp.numel() * 4 + Ba.numel(), max_copies=MAX_COPIES)
        kbit[k] = (cb, [(Bp, Ba)] + [(Bp.clone(), Ba.clone()) for _ in range(n - 1)])
    nf4 = None
    if bnb is not None:
        q, state = bnb.functional.quantize_4bit(W, blocksize=64, quant_type="nf4")
        n = copies_to_defeat_l2(q.numel() + N * K // 64 * 4, max_copies=MAX_COPIES)
        nf4 = [(q, state)] + [bnb.functional.quantize_4bit(W, blocksize=64, quant_type="nf4") for _ in range(n - 1)]

    for M in ms:
        a_copies = copies_to_defeat_l2(M * K * 2, max_copies=MAX_COPIES)
        As = [torch.randn(M, K, device="cuda", generator=g).to(dtype) for _ in range(a_copies)]
        # every path of this (shape, M) in interleaved rounds (timing.median_us_graphs_interleaved)
        paths = {
            "fp16": (
                lambda i, As=As, a_copies=a_copies: torch_F.linear(
                    As[i % a_copies], fp16_copies[i % len(fp16_copies)]
                ),
                max(len(fp16_copies), a_copies),
            )
        }
        if nf4 is not None:
            paths["nf4"] = (
                lambda i, As=As, a_copies=a_copies: bnb.matmul_4bit(
                    As[i % a_copies], nf4[i % len(nf4)][0].t(), quant_state=nf4[i % len(nf4)][1]
                ),
                max(len(nf4), a_copies),
            )
        for k in ks:
            cb, copies = kbit[k]
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            paths[f"k{k}"] = (
                lambda i, k=k, cb=cb, copies=copies, out=out, As=As, a_copies=a_copies: F.kbit_gemm(
                    As[i % a_copies], *copies[i % len(copies)], cb, k, N, K, out=out
                ),
                max(len(copies), a_copies),
            )
        if timing is None:
            rounds, iters, settle_max_s = ROUNDS, ITERS_PER_ROUND, 0.3
        else:
            rounds, iters, settle_max_s = timing["large_m" if M >= 1024 else "small_m"]
        row = median_us_graphs_interleaved(
            paths, rounds=rounds, iters=iters, settle_calls=SETTLE_CALLS, settle_max_s=settle_max_s
        )
        for k in ks:
            row[f"floor_k{k}"] = floor_us(N, K, M, k, bw)
        results[M] = row
        cells = " ".join(f"k{k}={row[f'k{k}']:.1f}" for k in ks)
        print(
            f"  {name:>24} M={M:<5} fp16={row['fp16']:.1f} nf4={row.get('nf4', float('nan')):.1f} {cells} us",
            flush=True,
        )
    return results


def print_table(all_results, ks, ms_shown):
    head = f"{'shape':>11} {'M':>5} {'fp16 us':>8} {'nf4 us':>7}"
    for k in ks:
        head += f" | k{k} us  xfp16 xnf4 %floor"
    print(head)
    for name, per_m in all_results.items():
        for M, row in per_m.items():
            if ms_shown and M not in ms_shown:
                continue
            line = f"{name:>11} {M:>5} {row['fp16']:>8.1f} {row.get('nf4', float('nan')):>7.1f}"
            for k in ks:
                t = row[f"k{k}"]
                nf = row.get("nf4", float("nan")) / t
                line += f" | {t:>6.1f} {row['fp16'] / t:>5.2f} {nf:>4.2f} {100 * row[f'floor_k{k}'] / t:>5.1f}%"
            print(line)


def check_targets(all_results, ks):
    """The issue's targets, each as (name, pass, worst case)."""
    checks = []

    def worst(cond_rows, value, better_high=True):
        vals = [(value(n, M, r, k), n, M, k) for n, M, r, k in cond_rows]
        if not vals:
            return None
        return min(vals) if better_high else max(vals)

    def rows(shapes, m_pred, kset):
        return [
            (n, M, r, k)
            for n, per in all_results.items()
            if n in shapes
            for M, r in per.items()
            if m_pred(M)
            for k in kset
        ]

    large = [n for n in LARGE if n in all_results]
    targets = [
        (
            "M=1 >= 60% of floor (large shapes, every k)",
            rows(large, lambda M: M == 1, ks),
            lambda n, M, r, k: r[f"floor_k{k}"] / r[f"k{k}"],
            0.60,
        ),
        (
            "M=16 >= 50% of floor (large shapes, every k)",
            rows(large, lambda M: M == 16, ks),
            lambda n, M, r, k: r[f"floor_k{k}"] / r[f"k{k}"],
            0.50,
        ),
        (
            "M=64 >= 1.3x fp16 (large shapes, k<=4)",
            rows(large, lambda M: M == 64, [k for k in ks if k <= 4]),
            lambda n, M, r, k: r["fp16"] / r[f"k{k}"],
            1.3,
        ),
        (
            "M>=1024 >= 0.9x fp16 (large shapes, every k)",
            rows(large, lambda M: M >= 1024, ks),
            lambda n, M, r, k: r["fp16"] / r[f"k{k}"],
            0.9,
        ),
        (
            "k=4 faster than NF4 (every shape and M)",
            rows(list(all_results), lambda M: True, [4] if 4 in ks else []),
            lambda n, M, r, k: r.get("nf4", float("nan")) / r["k4"],
            1.0,
        ),
        (
            "L8B-q/kv no slower than fp16 at M<=16",
            rows(["L8B-q", "L8B-kv"], lambda M: M <= 16, ks),
            lambda n, M, r, k: r["fp16"] / r[f"k{k}"],
            1.0,
        ),
    ]
    for name, rs, value, threshold in targets:
        w = worst(rs, value)
        if w is None or (isinstance(w[0], float) and math.isnan(w[0])):
            checks.append((name, None, "not measured"))
            continue
        ok = w[0] >= threshold
        checks.append((name, ok, f"worst {w[0]:.2f} at {w[1]} M={w[2]} k={w[3]} (target {threshold})"))
    return checks


def select_model_shapes(family_names=None, sample=0, part=None):
    """{label: (N, K, [Shape, ...])} for the distinct (N, K) of the chosen families, sorted by N*K; sample > 0
    takes that many spread evenly over the sorted list (deterministic); part = (i, n) keeps every n-th shape from
    the i-th (1-based), so parts 1/n .. n/n together run every shape once, each with a similar mix of sizes. A K that is not a multiple of 32
    (LinearKbit would pad it) is skipped with a message; no published shape here has one."""
    shapes = model_shapes()
    if family_names:
        unknown = sorted(set(family_names) - set(families()))
        if unknown:
            sys.exit(
                f"bench_kbit_gemm: --family {', '.join(unknown)} unknown; expected one of {', '.join(families())}"
            )
        shapes = [s for s in shapes if s.family in family_names]
    groups = sorted(distinct_shapes(shapes).items(), key=lambda kv: (kv[0][0] * kv[0][1], kv[0]))
    kept = []
    for (N, K), group in groups:
        if K % 32:
            print(f"  skipped {N} x {K} ({shape_label(group)}): K is not a multiple of 32 (LinearKbit pads it)")
            continue
        kept.append(((N, K), group))
    if part:
        kept = kept[part[0] - 1 :: part[1]]
    if sample and sample < len(kept):
        kept = [kept[round(i * (len(kept) - 1) / max(sample - 1, 1))] for i in range(sample)]
    return {f"{N}x{K} {shape_label(g)}": (N, K, g) for (N, K), g in kept}


def model_us(N, K, M, path):
    """Modelled time of one call on an H200 (roofline + launch): the runtime estimate and --dry-run's data."""
    wbytes = N * K * (2 if path == "fp16" else 0.5 + 1 / 16 if path == "nf4" else int(path[1:]) / 8 + 1 / 32)
    t = max((wbytes + 2 * M * (N + K)) / EST_BW, 2 * M * N * K / EST_FLOPS) * 1e6 + EST_LAUNCH_US
    return t


def estimate_shape_s(N, K, ms, ks, timing, dtype_bytes=2):
    """Seconds one shape takes: per path and M, the capture (rotate + 3 calls), `rounds` settles of
    min(cap, 1500 calls) and rounds * iters replays of `rotate` calls; plus ~1.5 s of quantization and copies.
    rotate follows copies_to_defeat_l2 with the H200's 60 MiB L2."""
    l2 = 60 * 2**20
    total = 1.5
    for M in ms:
        rounds, iters, cap = timing["large_m" if M >= 1024 else "small_m"]
        a_copies = min(MAX_COPIES, int(3 * l2 // (M * K * dtype_bytes)) + 1)
        for path in ["fp16", "nf4"] + [f"k{k}" for k in ks]:
            wb = N * K * (2 if path == "fp16" else 0.5 if path == "nf4" else int(path[1:]) / 8)
            rotate = max(a_copies, min(64 if path == "fp16" else MAX_COPIES, int(3 * l2 // wb) + 1))
            t = model_us(N, K, M, path) * 1e-6
            total += 0.01 + (rotate + 3) * t + rounds * (min(cap, SETTLE_CALLS * t) + iters * rotate * t)
    return total


def dry_run_results(shapes, ms, ks):
    """Modelled times with a deterministic +-20% spread per cell, in bench_shape's result layout."""
    out = {}
    for name, (N, K, _) in shapes.items():
        out[name] = {}
        for M in ms:
            row = {}
            for i, path in enumerate(["fp16", "nf4"] + [f"k{k}" for k in ks]):
                wobble = 1 + 0.2 * math.sin(N * 0.001 + K * 0.0007 + M * 0.37 + i)
                row[path] = model_us(N, K, M, path) * wobble
            for k in ks:
                row[f"floor_k{k}"] = floor_us(N, K, M, k, EST_BW)
            out[name][M] = row
    return out


def models_summary(all_results, shapes, ks):
    """Rows of (size class, M range, k, worst speedup over cuBLAS, its shape and M, geometric mean, cells);
    the k = 4 against NF4 worst cell; and the worst shapes (lowest speedup over cuBLAS at any M and k)."""
    rows = []
    for size, in_size in ((">=16M", lambda nk: nk >= BIG_NK), ("<16M", lambda nk: nk < BIG_NK)):
        for rname, in_range in M_RANGES:
            for k in ks:
                cells = [
                    (per[M]["fp16"] / per[M][f"k{k}"], name, M)
                    for name, per in all_results.items()
                    if in_size(shapes[name][0] * shapes[name][1])
                    for M in per
                    if in_range(M)
                ]
                if not cells:
                    continue
                worst = min(cells)
                gmean = math.exp(sum(math.log(c[0]) for c in cells) / len(cells))
                rows.append((size, rname, k, worst[0], worst[1], worst[2], gmean, len(cells)))
    nf4_cells = [
        (per[M]["nf4"] / per[M]["k4"], name, M)
        for name, per in all_results.items()
        for M in per
        if "nf4" in per[M] and "k4" in per[M]
    ]
    nf4_worst = min(nf4_cells) if nf4_cells else None
    per_shape = []
    for name, per in all_results.items():
        cells = [(per[M]["fp16"] / per[M][f"k{k}"], M, k) for M in per for k in ks]
        per_shape.append((min(cells), name))
    per_shape.sort()
    return rows, nf4_worst, per_shape


def print_models_summary(rows, nf4_worst, per_shape, shapes, gpu, dtype_name, n_worst=10):
    print(
        f"\nsummary, --suite models, {gpu}, {dtype_name}: speedup of kbit_gemm over cuBLAS {dtype_name} (>1 is faster)"
    )
    print(f"{'N*K':>5} {'M range':>9} {'k':>2} {'worst':>6} {'geomean':>7} {'cells':>5}  worst cell")
    for size, rname, k, w, wname, wm, gmean, n in rows:
        print(f"{size:>5} {rname:>9} {k:>2} {w:>6.2f} {gmean:>7.2f} {n:>5}  {wname} M={wm}")
    if nf4_worst:
        print(f"\nk = 4 against bitsandbytes NF4, worst cell: {nf4_worst[0]:.2f}x at {nf4_worst[1]} M={nf4_worst[2]}")
    print(f"\nworst shapes (lowest speedup over cuBLAS {dtype_name} at any M and k):")
    for (ratio, M, k), name in per_shape[:n_worst]:
        roles = ", ".join(f"{s.model}:{s.role}" for s in shapes[name][2])
        print(f"  {ratio:.2f}x at M={M} k={k}: {name.split()[0]} ({roles})")


def plot_models(all_results, shapes, ks, path, dtype_name, gpu):
    """Per k: the speedup over cuBLAS of every shape against M, large (N*K >= 16M) and small weights in two
    colours, with the worst cell per M of each as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks):
        for size, colour, in_size in (
            ("N*K >= 16M", "C0", lambda nk: nk >= BIG_NK),
            ("N*K < 16M", "C1", lambda nk: nk < BIG_NK),
        ):
            names = [n for n in all_results if in_size(shapes[n][0] * shapes[n][1])]
            if not names:
                continue
            worst = {}
            for n in names:
                for M, row in all_results[n].items():
                    r = row["fp16"] / row[f"k{k}"]
                    ax.scatter(M, r, s=4, color=colour, alpha=0.35)
                    worst[M] = min(worst.get(M, r), r)
            ms = sorted(worst)
            ax.plot(ms, [worst[M] for M in ms], color=colour, lw=1.2, label=f"{size}: worst")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"k = {k}")
        ax.set_xlabel("M (tokens)")
    axes[0][0].set_ylabel(f"speedup over cuBLAS {dtype_name}")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"kbit_gemm vs cuBLAS, {len(all_results)} model shapes, {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(all_results, ks, path, dtype_name, gpu):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 4), sharey=True)
    for ax, k in zip(axes if len(ks) > 1 else [axes], ks):
        for name, per_m in all_results.items():
            ms = sorted(per_m)
            ax.plot(ms, [per_m[M]["fp16"] / per_m[M][f"k{k}"] for M in ms], marker="o", ms=3, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"k = {k}")
        ax.set_xlabel("M (tokens)")
    (axes[0] if len(ks) > 1 else axes).set_ylabel(f"speedup over cuBLAS {dtype_name}")
    (axes[-1] if len(ks) > 1 else axes).legend(fontsize=7)
    fig.suptitle(f"kbit_gemm vs cuBLAS, {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_int_list(text, flag):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"bench_kbit_gemm: {flag} {text!r}: expected comma-separated integers")
    if not values or min(values) < 1:
        sys.exit(f"bench_kbit_gemm: {flag} {text!r}: expected positive integers")
    return values


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("named", "models"), default="named")
    parser.add_argument("--family", action="append", default=None, help="--suite models: one family (repeatable)")
    parser.add_argument("--sample", type=int, default=0, help="--suite models: this many shapes, spread over N*K")
    parser.add_argument("--part", default=None, help="--suite models: I/N, the I-th of N interleaved parts")
    parser.add_argument("--list", action="store_true", help="--suite models: list the chosen shapes and estimates")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0,
        help="--suite models: start no shape that would end past this many seconds (estimate x 1.5); the summary, "
        "JSON and plot cover the shapes run",
    )
    parser.add_argument("--dry-run", action="store_true", help="no GPU: modelled times through the whole flow")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default=None)
    parser.add_argument("--shapes", default=None, help="shape names (--suite named) or NxK of the suite (models)")
    parser.add_argument("--ms", "--m", dest="ms", default=None)
    parser.add_argument("--ks", "--k", dest="ks", default="2,3,4,5")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    if args.dtype is None:
        args.dtype = "bf16" if args.bf16 else "fp16"
    args.ks = parse_int_list(args.ks, "--k")
    if any(k not in (2, 3, 4, 5) for k in args.ks):
        sys.exit(f"bench_kbit_gemm: --k {args.ks}: expected values in 2..5")
    default_ms = MODELS_MS if args.suite == "models" else MS
    args.ms = parse_int_list(args.ms, "--m") if args.ms else list(default_ms)
    if args.sample < 0:
        sys.exit(f"bench_kbit_gemm: --sample {args.sample}: expected >= 0")
    if args.suite == "named":
        if args.family or args.sample or args.part:
            sys.exit("bench_kbit_gemm: --family, --sample and --part need --suite models")
        names = args.shapes.split(",") if args.shapes else list(SHAPES)
        unknown = [n for n in names if n not in SHAPES]
        if unknown:
            sys.exit(f"bench_kbit_gemm: --shapes {','.join(unknown)} unknown; expected some of {','.join(SHAPES)}")
        args.shape_table = {n: (*SHAPES[n], []) for n in names}
    else:
        part = None
        if args.part:
            try:
                part = tuple(int(x) for x in args.part.split("/"))
                assert len(part) == 2 and 1 <= part[0] <= part[1]
            except (ValueError, AssertionError):
                sys.exit(f"bench_kbit_gemm: --part {args.part!r}: expected I/N with 1 <= I <= N, e.g. 3/10")
        args.shape_table = select_model_shapes(args.family, args.sample, part)
        if args.shapes:  # NxK of the suite, e.g. 1024x2560,4672x4544
            wanted = args.shapes.split(",")
            table = {label: v for label, v in args.shape_table.items() if label.split()[0] in wanted}
            missing = sorted(set(wanted) - {label.split()[0] for label in table})
            if missing:
                sys.exit(
                    f"bench_kbit_gemm: --shapes {','.join(missing)}: not (N, K) of the chosen model shapes (--list)"
                )
            args.shape_table = table
    return args


BUDGET_MARGIN = 1.5  # measured shape times ran up to 1.35x the roofline estimate (H200)


def fits_budget(elapsed_s: float, estimate_s: float, budget_s: float) -> bool:
    """Whether a shape estimated at estimate_s may start after elapsed_s of a --budget-s run (0: no budget)."""
    return not budget_s or elapsed_s + BUDGET_MARGIN * estimate_s <= budget_s


def main(argv=None):
    args = parse_args(argv)
    models = args.suite == "models"
    timing = MODELS_TIMING if models else None
    ks, ms, shapes = args.ks, args.ms, args.shape_table
    dtype_name = args.dtype
    if models:
        est = {n: estimate_shape_s(N, K, ms, ks, MODELS_TIMING) for n, (N, K, _) in shapes.items()}
        print(f"--suite models: {len(shapes)} shapes x {len(ms)} M x (k = {ks}, fp16, NF4)")
        for n, (N, K, group) in shapes.items():
            print(
                f"  {n:<40} N*K={N * K / 2**20:6.1f}M  est {est[n]:5.0f} s  ({', '.join(s.model + ':' + s.role for s in group)})"
            )
        print(f"estimated total {sum(est.values()):.0f} s (H200 roofline model, timing.py's rotation and settle)")
        if args.list:
            return
    if args.dry_run:
        info = {
            "gpu": "dry run (modelled times, no GPU)",
            "sm_count": 0,
            "l2_bytes": 0,
            "torch": torch.__version__,
            "cuda": None,
        }
        bw = EST_BW
        all_results = dry_run_results(shapes, ms, ks)
        t0 = time.time()
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_kbit_gemm: needs a CUDA GPU (or --dry-run)")
        try:
            import bitsandbytes as bnb
        except Exception as exc:  # noqa: BLE001
            print(f"bitsandbytes not importable ({exc}); NF4 column skipped", file=sys.stderr)
            bnb = None
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float16
        info = gpu_info()
        bw = read_write_bandwidth()
        print(
            f"{info['gpu']}, {info['sm_count']} SMs, L2 {l2_bytes() / 2**20:.0f} MiB, read+write bandwidth {bw / 1e9:.0f} GB/s"
        )
        t0 = time.time()
        all_results = {}
        for name, (N, K, _) in list(shapes.items()):
            if models and not fits_budget(time.time() - t0, est[name], args.budget_s):
                print(f"  ({name}: skipped, --budget-s {args.budget_s:.0f} would be exceeded)", flush=True)
                del shapes[name]
                continue
            t_shape = time.time()
            all_results[name] = bench_shape(name, N, K, ms, ks, dtype, bw, bnb, timing)
            if models:
                print(f"  ({name}: {time.time() - t_shape:.0f} s, estimated {est[name]:.0f} s)", flush=True)
            if models:
                torch.cuda.empty_cache()
    print(
        f"\n(measured in {time.time() - t0:.0f} s)\nkbit_gemm, {dtype_name}, {info['gpu']}: median us; x = speedup (>1 is faster than the column); %floor = floor/time"
    )
    print_table(all_results, ks, None)
    record = {**info, "dtype": dtype_name, "suite": args.suite, "rw_bandwidth_GBps": bw / 1e9, "ms": ms, "ks": ks}
    if models:
        rows, nf4_worst, per_shape = models_summary(all_results, shapes, ks)
        record["shapes"] = {
            n: {"N": N, "K": K, "uses": [{"family": s.family, "model": s.model, "role": s.role} for s in g]}
            for n, (N, K, g) in shapes.items()
        }
        record["summary"] = [
            {
                "size": r[0],
                "m_range": r[1],
                "k": r[2],
                "worst": r[3],
                "worst_shape": r[4],
                "worst_m": r[5],
                "geomean": r[6],
                "cells": r[7],
            }
            for r in rows
        ]
        record["k4_vs_nf4_worst"] = (
            {"ratio": nf4_worst[0], "shape": nf4_worst[1], "M": nf4_worst[2]} if nf4_worst else None
        )
        record["worst_shapes"] = [{"shape": n, "ratio": r, "M": M, "k": k} for (r, M, k), n in per_shape[:20]]
    else:
        checks = check_targets(all_results, ks)
        record["targets"] = [{"target": n, "pass": ok, "detail": d} for n, ok, d in checks]
    record["results"] = all_results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.plot:
        if models:
            plot_models(all_results, shapes, ks, args.plot, dtype_name, info["gpu"])
        else:
            plot(all_results, ks, args.plot, dtype_name, info["gpu"])
    if models:
        print_models_summary(rows, nf4_worst, per_shape, shapes, info["gpu"], dtype_name)
        return
    print(f"\nsummary (M = 1, 16, 64, 1024), {info['gpu']}, {dtype_name}, floor bandwidth {bw / 1e9:.0f} GB/s")
    print_table(all_results, ks, (1, 16, 64, 1024))
    print("\ntargets")
    for name, ok, detail in checks:
        print(f"  [{'PASS' if ok else ('----' if ok is None else 'MISS')}] {name}: {detail}")


if __name__ == "__main__":
    main()

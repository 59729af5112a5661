"""Per-instruction warp-stall sampling of one kbit_gemm launch (ncu SourceCounters), summarised.

On the GPU machine (ncu on PATH, the package importable):
    python dev/ncu_stalls.py --out /tmp/ncu --shape 28672x8192 --m 1 --k 2 [--config 2] [--top 40]

Writes the ncu report and the SASS source page (CSV) to --out, then prints the stall reasons summed over
the kernel and the instructions with the most samples, each with its two largest reasons.
"""

import argparse
import csv
import io
import os
import subprocess
import sys


def run(cmd):
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def to_num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return None


def summarise(text, top):
    # the CSV may be preceded by ncu's own lines: start at the header row
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith(('"Address"', '"#"'))), None)
    if start is None:
        print("\n".join(lines[:40]))
        return
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        print("no rows")
        return
    cols = list(rows[0].keys())
    total_col = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    reason_cols = [
        c for c in cols if c.startswith("stall_") or c.lower().startswith("smsp__pcsamp_warps_issue_stalled")
    ]
    print("columns:", ", ".join(cols))
    if total_col is None:
        return
    total = sum(to_num(r[total_col]) or 0 for r in rows)
    print(f"\nsamples: {total:.0f}")
    if reason_cols:
        sums = {c: sum(to_num(r[c]) or 0 for r in rows) for c in reason_cols}
        print("stall reasons (share of all samples):")
        for c, v in sorted(sums.items(), key=lambda kv: -kv[1])[:14]:
            print(f"  {c:48s} {100 * v / max(total, 1):5.1f}%")
    src_col = "Source" if "Source" in cols else cols[1]
    ranked = sorted(rows, key=lambda r: -(to_num(r[total_col]) or 0))[:top]
    print(f"\ntop {top} instructions by samples:")
    for r in ranked:
        v = to_num(r[total_col]) or 0
        why = ""
        if reason_cols:
            rs = sorted(((to_num(r[c]) or 0, c) for c in reason_cols), reverse=True)[:2]
            why = "  ".join(f"{c.replace('stall_', '')}={100 * n / max(v, 1):.0f}%" for n, c in rs if n > 0)
        print(f"  {r.get('Address', ''):>6s} {100 * v / max(total, 1):5.2f}%  {r[src_col][:60]:60s} {why}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/ncu")
    ap.add_argument("--shape", default="28672x8192")
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--config", type=int, default=-1)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = f"{args.shape}_m{args.m}_k{args.k}_c{args.config}"
    rep = os.path.join(args.out, name)
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ncu_target.py")
    r = run(
        [
            "ncu",
            "--clock-control",
            "none",
            "-k",
            "regex:kbit_gemm",
            "--launch-count",
            "1",
            "--section",
            "SourceCounters",
            "--section",
            "WarpStateStats",
            "--section",
            "SpeedOfLight",
            "-f",
            "-o",
            rep,
            sys.executable,
            target,
            "--shape",
            args.shape,
            "--m",
            str(args.m),
            "--ks",
            str(args.k),
            "--configs",
            str(args.config),
        ]
    )
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-3000:])
        return
    r = run(["ncu", "-i", rep + ".ncu-rep", "--page", "details", "--csv"])
    with open(rep + "_details.csv", "w") as f:
        f.write(r.stdout)
    for l in r.stdout.splitlines():
        if any(
            x in l for x in ("Duration", "Warp Cycles Per Issued", "Issued Ipc", "Memory Throughput", "Compute (SM)")
        ):
            print("  ", l[-140:])
    r = run(["ncu", "-i", rep + ".ncu-rep", "--page", "source", "--csv", "--print-source", "sass"])
    if r.returncode != 0:
        print(r.stderr[-2000:])
        return
    with open(rep + "_source.csv", "w") as f:
        f.write(r.stdout)
    summarise(r.stdout, args.top)


if __name__ == "__main__":
    main()

"""Host time per call of a small linear layer: what a module costs on the CPU side, where the GPU is not the
bottleneck (weight 256 x 256, M = 1, eager, under torch.no_grad as in generate()).

    python benchmarking/bench_host_overhead.py [--n 256] [--k 4] [--calls 2000] [--dtype bf16] [--device cuda]

For each path, `calls` back-to-back calls after warm-up, twice:
  host us/call   CPU wall time of the loop up to the last call's return (no sync inside the loop): the time to
                 issue one call
  sync us/call   the same loop with torch.cuda.synchronize() only after it: max(host, GPU) per call
Paths: nn.Linear, bitsandbytes Linear4bit (NF4), LinearKbit (k), and the functional calls F.linear and
bitsandbytes_kbit.functional.kbit_gemm on the same repacked weight. The issue's target: LinearKbit no more host
time than Linear4bit and at most 10 us more than nn.Linear. --device cpu runs the same code (numbers meaningless,
NF4 and kbit_gemm skipped where they need CUDA).
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as torch_F
from torch import nn


def per_call_us(fn, calls, device):
    """(host us per call, us per call with one sync at the end), best of 3 loops each after warm-up."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(50):
        fn()
    if cuda:
        torch.cuda.synchronize()
    host, synced = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        synced.append((t2 - t0) / calls * 1e6)
    return min(host), min(synced)


def build_paths(args):
    """{name: zero-argument callable} for every path that can run on args.device."""
    import bitsandbytes_kbit.functional as F
    from bitsandbytes_kbit.nn import LinearKbit

    device, dtype = args.device, torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cuda = torch.device(device).type == "cuda"
    torch.manual_seed(0)
    linear = nn.Linear(args.n, args.n, bias=False, device=device, dtype=dtype).requires_grad_(False)
    x = torch.randn(1, args.n, device=device, dtype=dtype)
    paths = {"nn.Linear": lambda: linear(x), "F.linear": lambda: torch_F.linear(x, linear.weight)}
    kbit = LinearKbit.from_linear(linear, k=args.k, compute_dtype=dtype).prepare_for_inference()
    paths[f"LinearKbit k={args.k}"] = lambda: kbit(x)
    if cuda:
        import bitsandbytes as bnb

        nf4 = bnb.nn.Linear4bit(args.n, args.n, bias=False, compute_dtype=dtype, quant_type="nf4", device="meta")
        nf4.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4").to(device)
        paths["Linear4bit nf4"] = lambda: nf4(x)
        packed, absmax, cb = F.quantize_kbit(linear.weight, k=args.k)
        Bp, Ba = F.repack_kbit(packed, absmax, args.k, args.n, args.n)
        out = torch.empty(1, args.n, device=device, dtype=dtype)
        paths[f"kbit_gemm k={args.k}"] = lambda: F.kbit_gemm(x, Bp, Ba, cb, args.k, args.n, args.n)
        paths[f"kbit_gemm k={args.k} out="] = lambda: F.kbit_gemm(x, Bp, Ba, cb, args.k, args.n, args.n, out=out)
    else:
        print("(no CUDA device: Linear4bit and kbit_gemm skipped; LinearKbit runs its CPU path)")
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=256, help="the weight is n x n (a multiple of 32)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--dtype", choices=("fp16", "bf16"), default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.n < 32 or args.n % 32 or args.k not in (2, 3, 4, 5) or args.calls < 1:
        sys.exit(
            f"bench_host_overhead: --n {args.n} (expected a multiple of 32), --k {args.k} (expected 2..5), "
            f"--calls {args.calls} (expected >= 1)"
        )
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_host_overhead: --device cuda but no CUDA GPU; use --device cpu for a check of the script")
    gpu = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    rows = {}
    with torch.no_grad():
        for name, fn in build_paths(args).items():
            rows[name] = per_call_us(fn, args.calls, args.device)
    print(f"\nhost overhead, {gpu}, {args.dtype}, weight {args.n} x {args.n}, M = 1, {args.calls} calls, no_grad\n")
    print("| path | host us/call | sync us/call |\n|---|---|---|")
    for name, (host, synced) in rows.items():
        print(f"| {name} | {host:.1f} | {synced:.1f} |")
    kb = rows[f"LinearKbit k={args.k}"][0]
    print(f"\nLinearKbit - nn.Linear host time: {kb - rows['nn.Linear'][0]:+.1f} us (target <= +10)")
    if "Linear4bit nf4" in rows:
        print(f"LinearKbit - Linear4bit host time: {kb - rows['Linear4bit nf4'][0]:+.1f} us (target <= 0)")
        print(f"kbit_gemm - F.linear host time: {rows[f'kbit_gemm k={args.k}'][0] - rows['F.linear'][0]:+.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": gpu,
                    "dtype": args.dtype,
                    "n": args.n,
                    "k": args.k,
                    "calls": args.calls,
                    "us_per_call": {n: {"host": h, "sync": s} for n, (h, s) in rows.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

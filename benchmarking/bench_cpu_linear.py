"""Microbenchmark of LinearKbit on the CPU: the layer shapes of SmolLM2-135M, batch 1..M input rows, bf16 inputs.

Prints microseconds per call for nn.Linear in bf16 and float32, and LinearKbit for each k through the native
CPU kernels (fused for few rows, blocked dequantize + matmul for more) and through the PyTorch path (dequantize
the whole weight, then multiply). Best of repeated timings; on a shared machine run it when it is quiet.

    python benchmarking/bench_cpu_linear.py [--rows 1 4 8 16 64] [--k 2 3 4 5]
"""

import argparse
import time

import torch

from bitsandbytes_kbit import _cpu
from bitsandbytes_kbit.nn import LinearKbit

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576))  # (in, out): q/o, k/v, gate/up, down


def time_us(fn, *args, min_time=0.2, repeats=5) -> float:
    fn(*args)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        fn(*args)
        n += 1
    per = []
    for _ in range(repeats):
        reps = max(1, int(n * min_time / 0.05 / repeats))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        per.append((time.perf_counter() - t0) / reps * 1e6)
    return min(per)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU kernels: "
        f"{_cpu.ISA_NAMES[_cpu.isa] if _cpu.AVAILABLE else 'not built'}; microseconds per call"
    )
    header = ["in x out", "M", "bf16", "fp32"] + [f"k={k}" for k in args.k] + [f"k={k} torch" for k in args.k]
    print(" ".join(f"{h:>10}" for h in header))
    for K, N in SHAPES:
        lin = torch.nn.Linear(K, N, bias=False)
        lin_bf16 = torch.nn.Linear(K, N, bias=False).bfloat16()
        lin_bf16.weight.data.copy_(lin.weight.data)
        mods = {k: LinearKbit.from_linear(lin, k=k) for k in args.k}
        for M in args.rows:
            x = torch.randn(M, K).bfloat16()
            row = [f"{K}x{N}", str(M)]
            with torch.inference_mode():
                row.append(f"{time_us(lin_bf16, x):.1f}")
                xf = x.float()
                row.append(f"{time_us(lin, xf):.1f}")
                for k in args.k:
                    row.append(f"{time_us(mods[k], x):.1f}")
                available = _cpu.AVAILABLE
                _cpu.AVAILABLE = False
                try:
                    for k in args.k:
                        row.append(f"{time_us(mods[k], x, min_time=0.05, repeats=3):.1f}")
                finally:
                    _cpu.AVAILABLE = available
            print(" ".join(f"{c:>10}" for c in row), flush=True)


if __name__ == "__main__":
    main()

"""Decode speed of the demo's model variants on the CPU, repeated and interleaved (the demo times one run of each).

Loads SmolLM2-135M-Instruct as the demo does (bf16, k-bit, bitsandbytes NF4), then times greedy decoding of
--tokens tokens, batch 1, --repeats rounds over all variants in turn, and prints every run and the best per
variant. On a machine shared with other jobs the best run is the one least disturbed; say the load with the
numbers.

    python benchmarking/bench_cpu_decode.py [--variants bf16 k=5 k=4 k=3 k=2 nf4] [--tokens 32] [--repeats 3]
"""

import argparse
import os
import time

import torch
import transformers

from bitsandbytes_kbit import _cpu, demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["bf16", "k=5", "k=4", "k=3", "k=2", "nf4"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = demo.converted_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    kernels = _cpu.ISA_NAMES[_cpu.isa] if _cpu.AVAILABLE else "not built"
    print(f"{demo.device_title('cpu')}, torch {torch.__version__}, CPU kernels: {kernels}", flush=True)
    models = {}
    for v in args.variants:
        t0 = time.perf_counter()
        models[v] = demo.load(v, path, "cpu")
        print(f"{v}: loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    runs = {v: [] for v in args.variants}
    for r in range(args.repeats):
        for v in args.variants:
            _, tps = demo.complete(models[v], tok, args.tokens, "cpu", desc=v)
            runs[v].append(tps)
            print(f"round {r}: {v} {tps:.1f} tokens/s (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\ntokens/s, greedy decoding of {args.tokens} tokens, batch 1, {args.repeats} rounds")
    for v in args.variants:
        print(f"{v:>5} " + " ".join(f"{x:6.1f}" for x in runs[v]) + f"   best {max(runs[v]):6.1f}")


if __name__ == "__main__":
    main()

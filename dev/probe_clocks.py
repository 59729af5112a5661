"""Does a path slow down under sustained load? Replays each path's CUDA graph (weights rotated past the L2, as
the benchmark does) back to back for a while, sampling the SM clock and power (nvidia-smi), and times it
cold (one replay after the GPU idled) and sustained; also the per-call cost of a trivial kernel in a graph.

    python dev/probe_clocks.py --shapes 14336x4096 --ms 1024 --ks 4 --seconds 2
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))
from timing import capture_graph, replay_us

sys.path.insert(0, os.path.dirname(__file__))
from probe_paths import kbit_vs_fp16_cases


class ClockSampler:
    """nvidia-smi in the background, one line per 20 ms: (time, SM MHz, watts)."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "20"],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.3)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out, _ = self.proc.communicate()
        self.samples = []
        for line in out.splitlines():
            try:
                mhz, watts = (float(x) for x in line.split(","))
                self.samples.append((mhz, watts))
            except ValueError:
                pass


def sustained(graph, calls, seconds):
    """Per-call us of back-to-back replays for `seconds`, with the clock and power seen meanwhile."""
    end = time.time() + seconds
    times = []
    with ClockSampler() as sampler:
        while time.time() < end:
            times += replay_us(graph, calls, 4)
    s = sampler.samples[len(sampler.samples) // 4 :] or [(0.0, 0.0)]
    return statistics.median(times), statistics.median(x[0] for x in s), statistics.median(x[1] for x in s)


def trace(graph, calls, seconds, bin_s=0.025):
    """Median per-call us of replays in consecutive bins of bin_s, from the first replay on."""
    start, bins = time.time(), []
    while time.time() - start < seconds:
        t0 = time.time()
        times = []
        while time.time() - t0 < bin_s:
            times += replay_us(graph, calls, 1)
        bins.append(statistics.median(times))
    return bins


def cold(graph, calls, idle_s=1.0, reps=3):
    out = []
    for _ in range(reps):
        time.sleep(idle_s)
        out += replay_us(graph, calls, 1)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["14336x4096"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1024])
    ap.add_argument("--ks", nargs="+", type=int, default=[4])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--trace", action="store_true", help="per-replay times of each path right after the other ran")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())

    x = torch.zeros(1, device="cuda")
    graph, calls = capture_graph(lambda i: x.add_(1.0), rotate=1, calls_per_graph=64)
    print(f"trivial kernel in a graph: {statistics.median(replay_us(graph, calls, 50)):.2f} us per call")

    for shape, M, k, paths in kbit_vs_fp16_cases(args.shapes, args.ks, args.ms):
        graphs = {name: capture_graph(fn, rot) for name, (fn, rot) in paths.items()}
        if args.trace:
            for before, after in (("kbit", "fp16"), ("fp16", "kbit")):
                sustained(*graphs[before], args.seconds)
                print(f"{shape:>11s} M={M:5d} k={k} {after} right after {before}, per-call us by 25 ms:")
                print("   ", " ".join(f"{us:.0f}" for us in trace(*graphs[after], 0.6)))
            continue
        for rnd in range(2):
            for name, (g, c) in graphs.items():
                us_cold = cold(g, c)
                us, mhz, watts = sustained(g, c, args.seconds)
                print(
                    f"{shape:>11s} M={M:5d} k={k} {name:5s} round {rnd}: cold {us_cold:8.1f} us, "
                    f"sustained {us:8.1f} us at {mhz:6.0f} MHz {watts:6.0f} W"
                )


if __name__ == "__main__":
    main()

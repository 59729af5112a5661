"""Where one small-M call's time goes, CTA by CTA: a library built with -DKBIT_PROBE_TIMELINE
(dev/build_variant.sh timeline -DKBIT_PROBE_TIMELINE, then BNB_KBIT_LIBRARY=.whl/variants/timeline.so)
marks %globaltimer in thread 0 of every shared-A CTA at its first instruction (8), past the PDL wait (0), after
the LUT build (1), at the first compute (2), after the first k-step's compute (6), after the k-loop (3), after the
split-K arrival (4), after the output store (5) or the odd split's push (9), and its SM (7). The call is the last of a CUDA graph of back-to-back calls over rotated weight copies, as the
benchmark times them. Prints, per shape / k / M, the spread of each phase over the CTAs (ns) and the
phases of the CTA that ends the call.

    BNB_KBIT_LIBRARY=.whl/variants/timeline.so python dev/probe_timeline.py --shapes 14336x4096 --ks 2 3 --ms 1 16
"""

import argparse
import ctypes as ct
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_paths import weight_copies

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.cextension import get_lib

MARKS = 16
MAX_CTAS = 65536


def read_timeline(lib) -> np.ndarray:
    buf = np.zeros(MARKS * MAX_CTAS, dtype=np.uint64)
    if lib.ckbit_probe_timeline(buf.ctypes.data_as(ct.c_void_p), ct.c_size_t(buf.nbytes), 0):
        raise RuntimeError("ckbit_probe_timeline failed")
    return buf.reshape(MAX_CTAS, MARKS).astype(np.int64)


def phases(t: np.ndarray) -> dict:
    """Per-CTA phase lengths (ns) of the CTAs that ran (mark 0 set), relative to the first CTA's start."""
    ran = t[:, 0] > 0
    t = t[ran]
    start = t[:, 0].min()
    # non-last split CTAs leave after their arrival, odd splits of a push after it (mark 9); a mark 5 older than
    # mark 4 is from an earlier call
    end = np.maximum(np.maximum(t[:, 5], t[:, 4]), t[:, 9])
    return {
        "entry": t[:, 8] - start,  # negative: resident before the first CTA passed the PDL wait
        "wait": t[:, 0] - t[:, 8],
        "start": t[:, 0] - start,
        "lut": t[:, 1] - t[:, 0],
        "to_loop": t[:, 2] - t[:, 1],
        "step0": t[:, 6] - t[:, 2],
        "loop": t[:, 3] - t[:, 2],
        "arrive": np.where(t[:, 4] > 0, t[:, 4] - t[:, 3], 0),
        "reduce_store": np.where(t[:, 5] > t[:, 4], t[:, 5] - np.maximum(t[:, 4], t[:, 3]), 0),
        "push": np.where(t[:, 9] > 0, t[:, 9] - t[:, 3], 0),
        "end": end - start,
        "sm": t[:, 7],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["14336x4096", "4096x14336", "8192x8192"])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls in the graph")
    ap.add_argument("--brief", action="store_true", help="one line per case: medians and the critical CTA's phases")
    args = ap.parse_args()
    lib = get_lib()
    lib.ckbit_probe_timeline.restype = ct.c_int
    print(torch.cuda.get_device_name(), flush=True)
    for shape in args.shapes:
        N, K = (int(v) for v in shape.split("x"))
        W = (torch.randn(N, K, device="cuda") * 0.02).half()
        for k in args.ks:
            _, _, cb, _, copies = weight_copies(W, k)
            for M in args.ms:
                A = torch.randn(M, K, device="cuda").half()
                out = torch.empty(M, N, dtype=A.dtype, device="cuda")
                for i in range(3):
                    F.kbit_gemm(A, *copies[i % len(copies)], cb, k, N, K, out=out)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(args.calls):
                        F.kbit_gemm(A, *copies[i % len(copies)], cb, k, N, K, out=out)
                for _ in range(3):
                    g.replay()
                torch.cuda.synchronize()
                lib.ckbit_probe_timeline(None, ct.c_size_t(0), 1)
                ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                ev0.record()
                g.replay()
                ev1.record()
                torch.cuda.synchronize()
                per_call_us = ev0.elapsed_time(ev1) * 1000 / args.calls
                ph = phases(read_timeline(lib))
                n = len(ph["start"])
                crit = int(np.argmax(ph["end"]))
                if args.brief:
                    med = {name: float(np.median(ph[name])) for name in ph}
                    print(f"{shape} k={k} M={M} {per_call_us:5.1f} us/call span {ph['end'].max() / 1000:5.2f} | median "
                          + " ".join(f"{name} {med[name] / 1000:.2f}" for name in
                                     ("entry", "wait", "lut", "to_loop", "step0", "loop", "arrive"))
                          + " | critical " + " ".join(f"{name} {ph[name][crit] / 1000:.2f}" for name in
                                                       ("lut", "step0", "loop", "arrive", "reduce_store")))
                    continue
                print(f"{shape} k={k} M={M}: {n} CTAs on {len(set(ph['sm'].tolist()))} SMs, {per_call_us:.1f} us per call "
                      f"in the graph, first start -> last end {ph['end'].max() / 1000:.2f} us")
                for name in ("entry", "wait", "start", "lut", "to_loop", "step0", "loop", "arrive", "reduce_store", "push", "end"):
                    v = ph[name]
                    q = np.percentile(v, [0, 50, 90, 100])
                    print(f"   {name:>12}: min {q[0]:7.0f}  median {q[1]:7.0f}  p90 {q[2]:7.0f}  max {q[3]:7.0f}"
                          f"   (critical CTA {v[crit]:7.0f})")


if __name__ == "__main__":
    main()

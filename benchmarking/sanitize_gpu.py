"""compute-sanitizer memcheck, racecheck, initcheck and synccheck over the k-bit CUDA kernels.

    python benchmarking/sanitize_gpu.py                 # the four tools at once, one process each (5 min at most)
    python benchmarking/sanitize_gpu.py --tools memcheck --limit 20
    python benchmarking/sanitize_gpu.py --tools racecheck --part 2/8   # every 8th GEMM call from the 2nd (racecheck
                                                                       # over all 336 takes ~4 min on an H200)
    BNB_KBIT_LIBRARY=.whl/variants/lineinfo.so python benchmarking/sanitize_gpu.py --tools racecheck
        # racecheck's reports name source lines only on a -lineinfo build (dev/build_variant.sh lineinfo -lineinfo),
        # which the one known tool limitation (RACECHECK_MBARRIER_WAR below) is recognised by
    python benchmarking/sanitize_gpu.py --cases         # the cases alone, without a sanitizer (what each tool runs)

The cases: every GEMM config the device runs (forced, and the dispatcher's own choice) x k = 2..5 x fp16 / bf16 on
an odd weight (N = 584: a partial 16-row tile, not a multiple of 128; K_dim = 1056: a partial 128-wide k-step) at
M = 1 (planned for 1000 SMs: many k splits), 17 (132 SMs) and 300 (13 SMs: split tail tiles, clusters), bias on
every other; then quantize and dequantize (every input dtype and absmax format, an odd length, an out= 2 bytes off
16-byte alignment), repack and dequantize_tiled (whole, and a block off the origin). Inputs are made on the CPU and
copied, so nearly every kernel launched is one of ours; only kernels whose name contains "kbit" (all of ours: they
live in namespace kbit) are instrumented. memcheck and initcheck run with PyTorch's caching allocator off, so every
tensor is its own allocation and a read or write past one is caught.

Prints per tool: "<tool>: N errors" (racecheck also its hazard count), the kernels named in the reports, and the
tool's log path. Exit status 1 when any tool reports an error, times out or fails to run."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def run_cases(limit: int | None, gemm_part: tuple[int, int] = (1, 1)) -> None:
    import torch

    import bitsandbytes_kbit.functional as F
    from bitsandbytes_kbit.backends.cuda.ops import (
        _dequantize_tiled_block,
        gemm_config_available,
        gemm_num_configs,
        kbit_gemm_cuda,
    )

    g = torch.Generator().manual_seed(0)
    dev = "cuda"
    absmax_name = {v: name for name, v in F.ABSMAX_FORMATS.items()}
    N, K_dim = 584, 1056
    configs = [-1] + [c for c in range(gemm_num_configs()) if gemm_config_available(c)]
    # quantize / dequantize (the kernels of the absmax rule), repack, dequantize_tiled
    n = 3 * 1000 + 7
    x = torch.randn(n, generator=g)
    flat = 0
    for k in (2, 3, 4, 5):
        combos = [(torch.float16, torch.uint8)] if k != 3 else []
        if k == 3:
            combos = [
                (d, a) for d in (torch.float16, torch.bfloat16, torch.float32) for a in F.ABSMAX_FORMATS.values()
            ]
        for dtype, absmax_dtype in combos:
            cb = F.create_codebook(F.DEFAULT_CODEBOOK[k], k).to(dev)
            A = x.to(dev, dtype)
            packed, absmax = torch.ops.bitsandbytes.quantize_kbit(A, cb, k, absmax_dtype)
            F.quantize_kbit(A, k=k, codebook=cb, absmax_format=absmax_name[absmax_dtype])  # the mse kernel
            F.dequantize_kbit(packed, absmax, cb, k, n, dtype=dtype)
            buf = torch.empty(n + 8, dtype=dtype, device=dev)
            F.dequantize_kbit(packed, absmax, cb, k, n, dtype=dtype, out=buf[1 : n + 1])  # not 16-byte aligned
            torch.cuda.synchronize()
            flat += 1
        W = torch.randn(N, K_dim, generator=g) * 0.02
        for absmax_format in ("e4m4", "fp16"):
            packed, absmax, cb = F.quantize_kbit(W, k=k, absmax_format=absmax_format)
            packed, absmax, cb = packed.to(dev), absmax.to(dev), cb.to(dev)
            Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
            for dtype in (torch.float16, torch.bfloat16):
                torch.ops.bitsandbytes.dequantize_kbit_tiled(Bp, Ba, cb, k, N, K_dim, dtype)
                part = torch.empty(N - 16 - 8, K_dim - 128, dtype=dtype, device=dev)
                _dequantize_tiled_block(Bp, Ba, cb, k, N, K_dim, 16, N - 8, 128, K_dim, part)
            torch.cuda.synchronize()
    print(f"cases: {flat} quantize/dequantize combinations; repack and dequantize_tiled at k 2..5", flush=True)
    weights = {}
    for k in (2, 3, 4, 5):
        W = torch.randn(N, K_dim, generator=g) * 0.02
        for dtype, absmax_format in ((torch.float16, "e4m4"), (torch.bfloat16, "fp16")):
            packed, absmax, cb = F.quantize_kbit(W, k=k, absmax_format=absmax_format)  # CPU: no kernels
            Bp, Ba = F.repack_kbit(packed, absmax, k, N, K_dim)
            weights[(k, dtype)] = tuple(t.to(dev) for t in (Bp, Ba, cb))
    # one token count at a time over every config, k and dtype: a run cut short still covers each kernel
    cases = [
        (k, dtype, config, M, sms, weight)
        for M, sms in ((1, 1000), (17, 132), (300, 13))
        for config in configs
        for (k, dtype), weight in weights.items()
    ]
    cases = cases[gemm_part[0] - 1 :: gemm_part[1]]
    done = 0
    total = len(cases) if limit is None else min(limit, len(cases))
    t0 = time.time()
    for k, dtype, config, M, sms, (Bp, Ba, cb) in cases[:total]:
        A = torch.randn(M, K_dim, generator=g).to(dev, dtype)
        bias = torch.randn(N, generator=g).to(dev, dtype) if (k + M + (dtype == torch.bfloat16)) % 2 else None
        out = torch.empty(M, N, dtype=dtype, device=dev)
        kbit_gemm_cuda(A, Bp, Ba, cb, k, N, K_dim, bias, out, config=config, sm_count=sms, path="fused")
        torch.cuda.synchronize()
        done += 1
        if done % 40 == 0:
            print(f"cases: {done}/{total} GEMM calls, {time.time() - t0:.0f} s", flush=True)
    print(f"cases: {done} GEMM calls (configs {configs}, k 2..5, fp16/bf16, M 1/17/300)", flush=True)

    print("cases: done", flush=True)


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = os.path.join(base, "bin", "compute-sanitizer") if base else ""
        if path and os.path.exists(path):
            return path
    return None


def reports(log: str) -> list[str]:
    """The tool's reports: each starts at an unindented '=========' headline and takes the indented lines after it."""
    blocks: list[list[str]] = []
    for line in log.splitlines():
        if not line.startswith("========= ") or not line[10:].strip():
            continue
        if line.startswith("=========  "):  # indented: part of the current report
            if blocks:
                blocks[-1].append(line[10:].strip())
        else:
            blocks.append([line[10:].strip()])
    skip = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")
    return ["\n".join(b) for b in blocks if not b[0].startswith(skip)]


def ours(report: str) -> bool:
    """Whether a report involves this project's code: one of its kernels, or a host frame in its library."""
    return "kbit::" in report or "kbit" in report.split("Host Frame", 1)[0] or "libbitsandbytes_kbit" in report


# The one racecheck report shown to be a tool limitation (kbit_gemm_wgmma_ws.cuh, ws_fetch_unit): the warp-specialised
# kernels' weight ring, refilled by the producer's bulk copy (async proxy) after the consumers' LDS of the slot. The
# order is the mbarrier protocol's (each consumer warp's loads, __syncwarp, lane 0's arrive on w_empty with release
# semantics; the producer's wait on it with acquire semantics, then the copy), which racecheck does not model for
# bulk copies. Exactly this write site against exactly these read sites is not counted; any other report is.
RACECHECK_MBARRIER_WAR = (
    re.compile(r"Write access at kbit::bulk_copy_g2s\("),
    re.compile(r"Read access at void kbit::lds_unit_(words|absmax)<kbit::KbitWsConfig<"),
)


def racecheck_reports(log: str) -> list[tuple[str, list[str]]]:
    """The race analysis reports (--racecheck-report analysis): (write line, [read lines]) each."""
    out: list[tuple[str, list[str]]] = []
    for line in log.splitlines():
        body = line[9:].strip() if line.startswith("=========") else ""
        if "Race reported between" in body:
            out.append((body, []))
        elif out and body.startswith("and ") and "access at" in body:
            out[-1][1].append(body)
    return out


def summarize(tool: str, log: str) -> tuple[int | None, str]:
    """(errors, one-line detail) from a tool's output. initcheck counts only the reports that involve this project's
    code: only kernels named "kbit" are instrumented, so memory that PyTorch's own kernels wrote looks uninitialized
    to it, and its host API reports on PyTorch's copies of such memory (sort's index fill, .item() of a reduction)
    are that limitation, not reads of uninitialized memory; they are counted apart."""
    m = re.findall(r"ERROR SUMMARY: (\d+) error", log)
    errors = int(m[-1]) if m else None
    detail = []
    if tool == "initcheck" and errors:
        found = reports(log)
        mine = [r for r in found if ours(r)]
        if len(found) >= errors:  # every error has its report in the log
            detail.append(f"{errors - len(mine)} reports on memory written by uninstrumented PyTorch kernels")
            errors = len(mine)
        else:
            detail.append(f"only {len(found)} of {errors} reports printed ({len(mine)} ours): not narrowed")
    r = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", log)
    if r:
        detail.append(f"hazards {r[-1][0]} ({r[-1][1]} errors, {r[-1][2]} warnings)")
        found = racecheck_reports(log)
        write_re, read_re = RACECHECK_MBARRIER_WAR
        excused = [w for w, reads in found if write_re.search(w) and reads and all(read_re.search(x) for x in reads)]
        if len(found) == int(r[-1][0]):  # every report is in the log: count the others as errors
            errors = int(r[-1][1]) - len(excused)
            detail.append(f"{len(excused)} of them the weight ring's mbarrier-ordered reuse (RACECHECK_MBARRIER_WAR)")
        if found and not any(" in " in w for w, _ in found):
            detail.append(
                "the reports carry no source lines, so RACECHECK_MBARRIER_WAR cannot be recognized: run racecheck on a"
                " library built with -lineinfo (dev/build_variant.sh NAME -lineinfo; BNB_KBIT_LIBRARY=its path)"
            )
    kernels: dict[str, int] = {}
    for line in log.splitlines():
        if line.startswith("=========") and ("kbit::" in line) and ("in " in line or " at " in line):
            for name in set(re.findall(r"kbit::(\w+)", line)):
                kernels[name] = kernels.get(name, 0) + 1
    if kernels:
        detail.append("kernels in reports: " + ", ".join(f"{k} x{v}" for k, v in sorted(kernels.items())))
    return errors, "; ".join(detail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", action="store_true", help="run the cases in this process (what each tool runs)")
    ap.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    ap.add_argument("--limit", type=int, default=None, help="only the first N GEMM calls")
    ap.add_argument("--part", default="1/1", help="I/N: every N-th GEMM call from the I-th (flat cases run always)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per tool (the tools run at once)")
    ap.add_argument("--logs", default=os.environ.get("OUT", "."), help="folder for the tools' logs")
    args = ap.parse_args()
    try:
        part = tuple(int(v) for v in args.part.split("/"))
        if len(part) != 2 or not 1 <= part[0] <= part[1]:
            raise ValueError
    except ValueError:
        ap.error(f"--part={args.part!r}: expected I/N with 1 <= I <= N, e.g. 2/8")
    if args.cases:
        run_cases(args.limit, part)
        return 0
    sanitizer = find_sanitizer()
    if sanitizer is None:
        print("compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
        return 1
    # instrument only our kernels (option name by version: --kernel-name, formerly --kernel-regex; else all kernels)
    helptext = subprocess.run([sanitizer, "--help"], check=False, capture_output=True, text=True).stdout
    kernel_filter = next((["--" + o, "kns=kbit"] for o in ("kernel-name", "kernel-regex") if "--" + o in helptext), [])
    if not kernel_filter:
        print("note: this compute-sanitizer has no kernel name filter; every kernel is instrumented (slower)")
    os.makedirs(args.logs, exist_ok=True)
    cmd_cases = [sys.executable, os.path.abspath(__file__), "--cases", "--part", args.part]
    if args.limit is not None:
        cmd_cases += ["--limit", str(args.limit)]
    procs = {}
    t0 = time.time()
    for tool in args.tools:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if tool in ("memcheck", "initcheck"):
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # one allocation per tensor: out-of-bounds accesses show
        extra = ["--racecheck-report", "analysis"] if tool == "racecheck" else []
        # initcheck instruments every kernel: with the filter, memory that PyTorch's kernels wrote (torch.zeros of a
        # repacked weight's padding, the workspace's counters) reads as uninitialized in ours (H200: 20 such reports
        # in config 0 with the filter, 0 without, on the same cases)
        filt = [] if tool == "initcheck" else kernel_filter
        cmd = [sanitizer, "--tool", tool, *filt, "--print-limit", "100000", *extra, *cmd_cases]
        log_path = os.path.join(args.logs, f"sanitize_{tool}.log")
        with open(log_path, "w") as log_file:  # the child keeps its own descriptor
            procs[tool] = (subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env), log_path)
    status = 0
    for tool, (proc, log_path) in procs.items():
        try:
            rc = proc.wait(timeout=max(1, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        with open(log_path) as f:
            log = f.read()
        errors, detail = summarize(tool, log)
        last = [ln for ln in log.splitlines() if ln.startswith("cases:")]
        finished = "cases: done" in log
        if rc is None:
            state = f"TIMED OUT after {args.timeout} s (last: {last[-1] if last else 'no case ran'})"
        elif not finished:
            state = f"the cases did not finish (exit {rc}; see the log)"
        else:
            state = "all cases ran"
        shown = "?" if errors is None else str(errors)
        print(f"{tool}: {shown} errors; {state}{'; ' + detail if detail else ''}; log {log_path}")
        if errors != 0 or rc is None or not finished:
            status = 1
    print(f"total {time.time() - t0:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())

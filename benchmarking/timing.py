"""One timing helper for every benchmark script (STYLE.md section 11): CUDA events around each
call after warm-up, the median of many calls, and inputs rotated over enough copies that one
rotation touches more than 3x the L2 cache, so data streams from DRAM as it does in inference."""

import statistics
import time

import torch


def l2_bytes(device=None) -> int:
    return torch.cuda.get_device_properties(device or torch.cuda.current_device()).L2_cache_size


def copies_to_defeat_l2(bytes_per_copy: int, factor: float = 3.0, max_copies: int = 64) -> int:
    return max(1, min(max_copies, int(factor * l2_bytes() // max(bytes_per_copy, 1)) + 1))


def median_us(fn, rotate: int = 1, warmup: int = 10, iters: int = 100) -> float:
    """Median time in microseconds of fn(i) for i cycling over range(rotate)."""
    for i in range(warmup):
        fn(i % rotate)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i % rotate)
        ends[i].record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def capture_graph(fn, rotate: int = 1, warmup: int = 3, calls_per_graph: int = 0) -> tuple[torch.cuda.CUDAGraph, int]:
    """A CUDA graph holding one call of fn(i) for each of `rotate` inputs (or `calls_per_graph` calls
    cycling over them), after `warmup` eager calls on a side stream; returns (graph, calls)."""
    calls = calls_per_graph or rotate
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            fn(i % rotate)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % rotate)
    graph.replay()
    torch.cuda.synchronize()
    return graph, calls


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, iters: int) -> list[float]:
    """Per-call microseconds of `iters` replays of graph (events around each replay)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return times


def median_us_graph(fn, rotate: int = 1, warmup: int = 3, iters: int = 50, calls_per_graph: int = 0) -> float:
    """Median per-call time of fn(i) replayed from a CUDA graph that holds one call for each of
    `rotate` inputs (or `calls_per_graph` calls cycling over them): launch gaps hidden, as in
    decoding with CUDA graphs."""
    graph, calls = capture_graph(fn, rotate, warmup, calls_per_graph)
    return statistics.median(replay_us(graph, calls, iters))


def settle(graph: torch.cuda.CUDAGraph, seconds: float) -> None:
    """Untimed replays of graph for `seconds` (at least one): the GPU's clock and power reach this path's
    steady state before it is timed."""
    end = time.perf_counter() + seconds
    graph.replay()
    torch.cuda.synchronize()
    while time.perf_counter() < end:
        graph.replay()
        torch.cuda.synchronize()


def median_us_graphs_interleaved(
    paths: dict, rounds: int = 5, iters: int = 4, settle_calls: int = 0, settle_max_s: float = 0.3
) -> dict:
    """Median per-call time of several paths of the same product, paths = {name: (fn, rotate)}, each
    replayed from its own CUDA graph (as median_us_graph) in `rounds` interleaved rounds of `iters`
    replays, the order rotating by one path each round. Timed one after the other, the paths timed last
    ran on a hotter, lower-clocked GPU at large M (H100, 4096 x 4096 M = 4096: k = 2, 3, 4, 5 in that
    order took 218, 223, 225 and 228 us on the same staged path); interleaved, drift falls on all alike.
    settle_calls > 0: before its replays in a round, each path first runs untimed for as long as
    settle_calls of its calls take (at most settle_max_s). Where the GPU runs at its power limit (large M)
    its clock follows the power drawn, with a lag of ~0.1-0.3 s (dev/probe_clocks.py): without settling, a
    path timed right after a lighter one borrows that one's higher clock and a lighter path the heavier
    one's lower clock (H100, 14336 x 4096 M = 1024: cuBLAS fp16 at 1440 MHz and kbit_gemm k = 4 at 1570 MHz
    when each runs on its own; in short interleaved rounds 174.8 and 204.0 us, settled 187 and 198).
    A path whose capture fails is timed with events (median_us) after the rounds."""
    graphs, eager, settle_s = {}, {}, {}
    for name, (fn, rotate) in paths.items():
        try:
            graphs[name] = capture_graph(fn, rotate)
        except Exception as exc:  # noqa: BLE001  (a path that cannot be captured is timed with events)
            print(f"    ({name}: graph capture failed: {type(exc).__name__}: {exc}; timing with events)")
            torch.cuda.synchronize()
            eager[name] = (fn, rotate)
            continue
        if settle_calls:
            per_call_s = min(replay_us(*graphs[name], 2)) * 1e-6
            settle_s[name] = min(settle_max_s, settle_calls * per_call_s)
    times = {name: [] for name in graphs}
    names = list(graphs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
            if settle_calls:
                settle(graphs[name][0], settle_s[name])
            times[name] += replay_us(*graphs[name], iters)
    result = {name: statistics.median(t) for name, t in times.items()}
    for name, (fn, rotate) in eager.items():
        result[name] = median_us(fn, rotate=rotate, iters=rounds * iters * 2)
    return {name: result[name] for name in paths}


def read_write_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a large elementwise read + write (x + 1 into another buffer),
    counting bytes read plus bytes written: the DRAM ceiling used for bandwidth floors."""
    n = nbytes // 4
    x = torch.rand(n, device="cuda")
    y = torch.empty_like(x)
    us = median_us(lambda i: torch.add(x, 1.0, out=y), warmup=3, iters=20)
    return 2 * n * 4 / (us * 1e-6)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy_, counting bytes read plus bytes written."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = median_us(lambda i: y.copy_(x), warmup=3, iters=20)
    return 2 * nbytes / (us * 1e-6)


def gpu_info() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }

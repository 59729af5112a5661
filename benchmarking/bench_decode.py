"""Decode speed of a transformers LlamaForCausalLM of Llama-3-8B shape (random weights) in bf16, NF4 and k = 2..5.

    python benchmarking/bench_decode.py [--layers 32] [--formats bf16,nf4,k2,k3,k4,k5] [--modes a,b,c]
        [--batch 1,16] [--new-tokens 64] [--prompt-len 16] [--compile-mode default]
        [--fuse] [--profile] [--json out.json] [--plot out.png]
    python benchmarking/bench_decode.py --merge run1.json run2.json [--json out.json] [--plot out.png]
        # one table of runs made in parts (a later run's cell replaces an earlier one's)
    python benchmarking/bench_decode.py --tiny --device cpu      # the same code paths on a tiny model (no GPU)

Models (one per format, built one after the other from the same seed, on the GPU, with random init):
  bf16  LlamaForCausalLM built in bf16 under torch.device(device) (no checkpoint is written or read)
  kK    the project's transformers config BitsAndBytesKbitConfig(bnb_kbit_bits=K, compute dtype bf16): every
        nn.Linear outside its modules_to_not_convert (lm_head) becomes LinearKbit.from_linear(...) with the config's
        k and codebook, then prepare_for_inference() (what the transformers quantizer does after loading)
  nf4   bitsandbytes Linear4bit(quant_type="nf4", compute_dtype=bf16) for the same modules, its weight a Params4bit
        quantized by .to(device) (the path of transformers' BitsAndBytesConfig(load_in_4bit=True, nf4))
Modes (time per generated token, prefill excluded: (a, b) generate() of N + 1 tokens, a logits processor stamps
each step after a device sync, time = (last stamp - first) / N; (c) the replay loop of N steps is timed):
  a  model.generate() eager, default (dynamic) cache
  b  model.generate(cache_implementation="static"): transformers compiles the forward itself
  c  one decode step (StaticCache, one token with cache_position, a prepared 4D attention mask, in-place updated
     input buffers, greedy argmax) compiled by torch.compile (inductor without its own CUDA graphs; --compile-mode)
     and captured in a torch.cuda.CUDAGraph, replayed per token: the recipe of docs/usage.md. Its first greedy
     tokens are compared with those of (a). On the CPU the compiled step runs without a graph (said in the output).
For (b) and (c) the bench counts, from torch's own counters and logs, the graph breaks, the graphs compiled and the
"skipping cudagraphs" lines (a second table and the JSON; the logs are on while a cell compiles and off while it is
timed); each of these cells starts from torch._dynamo.reset().
tokens/s is per sequence (a batch of 16 makes 16 times as many tokens); the ratio is against bf16 on the same
mode and batch.
"""

import argparse
import contextlib
import inspect
import json
import logging
import os
import statistics
import sys
import time

import torch
from torch import nn

FORMATS = ("bf16", "nf4", "k2", "k3", "k4", "k5")
MODES = ("a", "b", "c")
# Llama-3-8B config.json; --tiny: the same architecture at toy width for a CPU check of every code path
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}
CHECK_TOKENS = 8  # greedy tokens of (c) compared with (a)


def build_model(args, fmt):
    """The model of one format, on args.device, in bf16, from seed 0; returns (model, how it was built)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(TINY if args.tiny else LLAMA3_8B)
    if args.layers:
        values["num_hidden_layers"] = args.layers
    config = LlamaConfig(**values, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if fmt == "bf16":
        return model, "bf16 LlamaForCausalLM, random init on the device"
    skip = ["lm_head"]
    if fmt == "nf4":
        import bitsandbytes as bnb

        for name, module in list(model.named_modules()):
            if type(module) is not nn.Linear or any(name == s or name.endswith("." + s) for s in skip):
                continue
            new = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                compute_dtype=torch.bfloat16,
                quant_type="nf4",
                device="meta",
            )
            new.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4").to(args.device)
            if module.bias is not None:
                new.bias = nn.Parameter(module.bias.data, requires_grad=False)
            model.set_submodule(name, new)
        return model, "bitsandbytes Linear4bit(nf4, compute bf16) for every nn.Linear but lm_head"
    from bitsandbytes_kbit.integrations.transformers import BitsAndBytesKbitConfig
    from bitsandbytes_kbit.nn import LinearKbit

    qconfig = BitsAndBytesKbitConfig(bnb_kbit_bits=int(fmt[1:]), bnb_kbit_compute_dtype="bfloat16")
    skip = list(qconfig.modules_to_not_convert or skip)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or any(name == s or name.endswith("." + s) for s in skip):
            continue
        new = LinearKbit.from_linear(
            module, k=qconfig.bnb_kbit_bits, codebook=qconfig.codebook_spec(), compute_dtype=qconfig.compute_dtype
        )
        model.set_submodule(name, new.prepare_for_inference())
    model.config.quantization_config = qconfig
    how = f"BitsAndBytesKbitConfig(bnb_kbit_bits={fmt[1:]}) -> LinearKbit.from_linear for every nn.Linear but {skip}"
    if args.fuse:
        from bitsandbytes_kbit.nn import fuse_projections

        how += f"; fuse_projections: {fuse_projections(model)} groups (q/k/v, gate/up) served by one GEMM each"
    return model, how


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class StepClock:
    """A logits processor that only records when each step's logits are ready (after a device sync): generate()
    calls it once per new token, so (last - first) / (calls - 1) is the time per token with prefill excluded."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return scores


def generate_timed(model, prompt, n_new, static, device, repeats=3):
    """(seconds per new token with prefill excluded, the generated tokens): the median of `repeats` timed runs, since
    an eager run is bound by host time, which varies from run to run. One length for warm-up and timing, so mode (b)
    compiles once."""
    from transformers import LogitsProcessorList

    kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    kwargs.update(max_new_tokens=n_new + 1, min_new_tokens=n_new + 1)
    if static:
        kwargs["cache_implementation"] = "static"
    for _ in range(2 if static else 1):  # warm-up (b: transformers compiles the forward here)
        model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    per_token = []
    with quiet_torch_logs():
        for _ in range(repeats):
            clock = StepClock(device)
            out = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), logits_processor=LogitsProcessorList([clock]), **kwargs
            )
            sync(device)
            per_token.append((clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1))
    return statistics.median(per_token), out[:, prompt.shape[1] :]


TORCH_LOGS_ON = {"perf_hints": True, "cudagraphs": True}  # what main() turns on to see "skipping cudagraphs" lines
_logs_on = False


@contextlib.contextmanager
def quiet_torch_logs():
    """The timed runs without the perf-hint and cudagraphs logs that main() turns on: their records cost host time in
    every compiled call, which mode (b) would count as the model's (H200, 32 layers, (b) per token with them on: k = 4
    11.1 ms, bf16 10.4; off: 6.3 and 8.6). Compiling and recording happen in the warm-up, where the logs are on."""
    if not _logs_on:
        yield
        return
    torch._logging.set_logs()
    try:
        yield
    finally:
        torch._logging.set_logs(**TORCH_LOGS_ON)


def cache_kwarg(model):
    """The forward's name for the cache argument (transformers 5 renames past_key_values to cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def compile_counts():
    """torch's own counters: (graph breaks, graphs compiled, compiled graphs that skipped CUDA graphs)."""
    from torch._dynamo.utils import counters

    return (
        sum(counters["graph_break"].values()),
        int(counters["stats"]["unique_graphs"]),
        int(counters["inductor"]["cudagraph_skips"]),
    )


@torch.no_grad()
def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, by its name: the k-bit GEMM, cuBLAS, attention, Triton (inductor's fused ops), other."""
    n = name.lower()
    if "triton" in n:  # inductor names a fused kernel after the ops around it ("triton_poi_fused_kbit_gemm_mul_silu")
        return "triton"
    if "kbit" in n:
        return "kbit_gemm"
    if any(s in n for s in ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")):
        return "cublas"
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    return "other"


def kernel_breakdown(run_step, steps: int = 5) -> dict:
    """GPU time per decode step by kernel kind (torch.profiler over `steps` graph replays): {kind: {"us": time per
    step, "kernels": launches per step}}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    kinds: dict = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = kinds.setdefault(kernel_kind(event.name), {"us": 0.0, "kernels": 0.0})
            entry["us"] += event.device_time / steps
            entry["kernels"] += 1 / steps
    return kinds


def graph_decode(model, prompt, n_new, device, compile_mode, profile_steps=0):
    """Mode (c): the decode step compiled by torch.compile (inductor, without its own CUDA graphs) and captured in
    one torch.cuda.CUDAGraph, replayed per token (on the CPU the compiled step runs as is). Returns (seconds per new
    token, the generated tokens, whether a CUDA graph was used, seconds spent compiling and capturing, and with
    profile_steps > 0 on CUDA the kernel_breakdown of that many further replays, else None)."""
    from transformers import StaticCache

    B, P = prompt.shape
    max_len = P + n_new + 8 + profile_steps
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    ck = cache_kwarg(model)
    prefill_mask = torch.ones(P, max_len, dtype=torch.bool, device=device).tril(0)[None, None].expand(B, 1, P, max_len)

    def prefill():
        """Eager prefill into the (reset) cache; its greedy token is the first generated one, as in generate()."""
        cache.reset()
        out = model(
            prompt,
            **{ck: cache},
            cache_position=torch.arange(P, device=device),
            attention_mask=prefill_mask,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].argmax(-1, keepdim=True)

    # the step's static input buffers: the current token, its position, the 4D mask (True = attend; used as is)
    tok = prefill()
    pos = torch.tensor([P], device=device)
    mask = torch.zeros(B, 1, 1, max_len, dtype=torch.bool, device=device)

    def step():
        mask.index_fill_(-1, pos, True)  # the new token attends to itself
        logits = model(
            tok,
            **{ck: cache},
            cache_position=pos,
            position_ids=pos.expand(B, 1),
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        pos.add_(1)

    torch._dynamo.reset()  # a fresh compile per format and batch (Dynamo's recompile limit would stop at 8)
    t_compile = time.perf_counter()
    compiled = torch.compile(step, mode=None if compile_mode == "default" else compile_mode, dynamic=False)
    use_graph = torch.device(device).type == "cuda"
    if use_graph:
        # compile and warm up on a side stream (the k-bit layers, cuBLAS and the Triton kernels set up their state),
        # then capture one step
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                compiled()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled()
        run_step = graph.replay
    else:
        compiled()
        run_step = compiled
    sync(device)
    t_compile = time.perf_counter() - t_compile
    # the warm-up advanced the cache (its write position is a tensor inside it): reset it in place, prefill again,
    # and set the buffers the graph reads
    tok.copy_(prefill())
    pos.fill_(P)
    mask.zero_()
    mask[..., :P] = True
    tokens = torch.empty(B, n_new + 1, dtype=torch.long, device=device)
    tokens[:, :1] = tok
    sync(device)
    t0 = time.perf_counter()
    for i in range(n_new):
        run_step()
        tokens[:, i + 1 : i + 2].copy_(tok)
    sync(device)
    seconds = (time.perf_counter() - t0) / n_new
    breakdown = kernel_breakdown(run_step, profile_steps) if profile_steps and use_graph else None
    return seconds, tokens, use_graph, t_compile, breakdown


class SkipCounter(logging.Handler):
    """Counts torch log records that say cudagraphs were skipped (mode b)."""

    def __init__(self):
        super().__init__()
        self.lines, self.last = [], None

    def emit(self, record):
        if record is self.last:  # the same record propagating through two loggers that both hold this handler
            return
        self.last = record
        msg = record.getMessage()
        if "skipping cudagraph" in msg.lower():
            self.lines.append(msg.splitlines()[0][:200])


def attach_skip_counter(counter):
    """Hold `counter` on every torch logger (torch's logging setup can stop records from propagating to "torch");
    the modules that log the skips are imported first so that their loggers exist. Returns the loggers."""
    for module in (
        "torch._inductor.cudagraph_utils",
        "torch._inductor.output_code",
        "torch._inductor.cudagraph_trees",
    ):
        try:
            __import__(module)
        except ImportError:
            print(f"bench_decode: {module} not in this torch; its skip lines are counted only if it exists elsewhere")
    loggers = [logging.getLogger("torch")] + [
        lg
        for name, lg in logging.Logger.manager.loggerDict.items()
        if name.startswith("torch.") and isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        lg.addHandler(counter)
    return loggers


def parse_list(text, flag, allowed=None, cast=str):
    try:
        values = [cast(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"bench_decode: {flag} {text!r}: expected a comma-separated list")
    bad = [v for v in values if allowed is not None and v not in allowed]
    if not values or bad:
        sys.exit(f"bench_decode: {flag} {text!r}: expected some of {', '.join(map(str, allowed))}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=0, help="decoder layers (default: 32, or 2 with --tiny)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--modes", default="a,b,c")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "max-autotune-no-cudagraphs"),
        help="torch.compile mode of the (c) step (inductor's own CUDA graphs stay off: (c) captures its own)",
    )
    p.add_argument("--tiny", action="store_true", help="toy widths (a check of the code paths, e.g. on the CPU)")
    p.add_argument(
        "--fuse", action="store_true", help="k-bit models: fuse_projections (one GEMM for q/k/v, one for gate/up)"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="(c) on CUDA: GPU time per step by kernel kind (k-bit GEMM, cuBLAS, ...)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="print and save the union of earlier runs")
    args = p.parse_args(argv)
    if args.merge:
        return args
    args.formats = parse_list(args.formats, "--formats", FORMATS)
    args.modes = parse_list(args.modes, "--modes", MODES)
    args.batch = parse_list(args.batch, "--batch", None, int)
    if min(args.batch) < 1 or args.new_tokens < 2 or args.prompt_len < 1 or args.layers < 0:
        sys.exit("bench_decode: --batch, --prompt-len >= 1, --new-tokens >= 2 and --layers >= 0 expected")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_decode: --device cuda but no CUDA GPU; use --tiny --device cpu for a CPU check")
    return args


def run_cell(model, fmt, mode, B, prompt, args, skips, ref_tokens):
    """One (format, mode, batch) cell: its result row (with the compile checks for modes b and c) and the generated
    tokens. Modes b and c start from a fresh Dynamo state and count what torch reports while they run."""
    row = {"format": fmt, "mode": mode, "batch": B, "fuse": bool(args.fuse and fmt.startswith("k"))}
    n_lines, counts = len(skips.lines), compile_counts()
    if mode == "a":
        s_tok, tokens = generate_timed(model, prompt, args.new_tokens, False, args.device)
    elif mode == "b":
        torch._dynamo.reset()  # transformers compiles the forward for this model (recompile limit: 8 per code)
        s_tok, tokens = generate_timed(model, prompt, args.new_tokens, True, args.device)
    else:
        s_tok, tokens, used, t_compile, breakdown = graph_decode(
            model, prompt, args.new_tokens, args.device, args.compile_mode, 5 if args.profile else 0
        )
        row["cuda_graph"] = used
        row["compile_s"] = t_compile
        if breakdown is not None:
            row["kernels"] = breakdown
            total = sum(v["us"] for v in breakdown.values())
            print(
                f"  [{fmt} B={B} c] GPU time per step {total / 1e3:.2f} ms: "
                + ", ".join(
                    f"{kind} {v['us'] / 1e3:.2f} ms ({v['kernels']:.0f} kernels)"
                    for kind, v in sorted(breakdown.items(), key=lambda kv: -kv[1]["us"])
                )
            )
        print(
            f"  [{fmt} B={B} c] step compiled (torch.compile mode={args.compile_mode}) and "
            + (
                "captured in a CUDA graph, replayed for every decode step"
                if used
                else "run as compiled (no CUDA device: CUDA graphs skipped)"
            )
            + f"; compile and capture {t_compile:.1f} s"
        )
        if ref_tokens is not None:
            n = min(CHECK_TOKENS, tokens.shape[1], ref_tokens.shape[1])
            same = (tokens[:, :n] == ref_tokens[:, :n]).all(0).tolist()
            agree = same.index(False) if False in same else n
            row["tokens_match_a"] = agree
            print(
                f"  [{fmt} B={B} c] first {n} greedy tokens against (a): {agree} of {n} agree"
                + (
                    ""
                    if agree == n
                    else " (the compiled step rounds bf16 differently from eager; on random weights a near-tie"
                    " can flip)"
                )
            )
    row["ms_per_token"] = s_tok * 1e3
    row["tokens_per_s"] = 1.0 / s_tok
    if mode in ("b", "c"):
        breaks, graphs, skipped = (now - before for now, before in zip(compile_counts(), counts))
        if mode == "b" and graphs == 0:
            print(f"  [{fmt} B={B} b] transformers did not compile the forward here (it does so on CUDA devices)")
        row["graph_breaks"] = breaks
        row["compiled_graphs"] = graphs
        row["inductor_cudagraph_skips"] = skipped
        row["skipping_cudagraphs_lines"] = skips.lines[n_lines:]
    return row, tokens


def merge_runs(args):
    """The cells of several runs' JSON files as one run: same GPU, model and token counts; a later file's cell
    replaces an earlier one's."""
    runs = []
    for path in args.merge:
        with open(path) as f:
            runs.append(json.load(f))
    keys = ("gpu", "tiny", "new_tokens", "prompt_len")
    for path, run in zip(args.merge[1:], runs[1:]):
        if any(run[k] != runs[0][k] for k in keys) or (run["layers"] or 32) != (runs[0]["layers"] or 32):
            sys.exit(f"bench_decode: {path} was not run like {args.merge[0]} (compare {', '.join(keys)}, layers)")
    cells = {}
    for run in runs:
        for row in run["results"]:
            row.setdefault("fuse", bool(run.get("fuse") and row["format"].startswith("k")))  # runs before the row flag
            cells[(row["format"], row["mode"], row["batch"])] = row
    merged = dict(runs[-1], results=list(cells.values()), merged_from=[os.path.basename(p) for p in args.merge])
    merged["builds"] = {k: v for run in runs for k, v in run["builds"].items()}
    order = {name: i for i, name in enumerate(FORMATS)}
    args.formats = sorted({r["format"] for r in merged["results"]}, key=order.get)
    args.modes = sorted({r["mode"] for r in merged["results"]})
    args.batch = sorted({r["batch"] for r in merged["results"]})
    args.layers, args.tiny, args.new_tokens = merged["layers"], merged["tiny"], merged["new_tokens"]
    print_table(merged["results"], args, merged["gpu"], merged["torch"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(merged, f, indent=1)
    if args.plot:
        plot(merged["results"], args, merged["gpu"])


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge_runs(args)
    skips = SkipCounter()
    if "b" in args.modes or "c" in args.modes:
        global _logs_on
        try:  # torch's perf hints / cudagraphs logs carry the "skipping cudagraphs" lines; they go to stderr too
            torch._logging.set_logs(**TORCH_LOGS_ON)
            _logs_on = True
        except Exception as exc:  # noqa: BLE001  (an older torch without this artifact: the count stays 0)
            print(f"bench_decode: torch perf-hint logs not available ({exc}); skipped-cudagraph lines not counted")
        attach_skip_counter(skips)
    gen = torch.Generator().manual_seed(1)
    vocab = (TINY if args.tiny else LLAMA3_8B)["vocab_size"]
    prompts = {B: torch.randint(1, vocab, (B, args.prompt_len), generator=gen).to(args.device) for B in args.batch}
    gpu = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    results, builds = [], {}
    for fmt in args.formats:
        t_build = time.time()
        model, how = build_model(args, fmt)
        builds[fmt] = how
        layers = model.config.num_hidden_layers
        print(f"[{fmt}] {how} (built in {time.time() - t_build:.1f} s, {layers} layers)", flush=True)
        for B in args.batch:
            ref_tokens = None
            for mode in args.modes:
                t_mode = time.time()
                try:
                    row, tokens = run_cell(model, fmt, mode, B, prompts[B], args, skips, ref_tokens)
                except Exception as exc:  # noqa: BLE001  (one failing cell is reported, the others still run)
                    print(f"  [{fmt} B={B} {mode}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                    results.append({"format": fmt, "mode": mode, "batch": B, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                if mode == "a":
                    ref_tokens = tokens
                results.append(row)
                extra = ""
                if mode in ("b", "c"):
                    lines = row["skipping_cudagraphs_lines"]
                    extra = (
                        f"; graph breaks {row['graph_breaks']}, graphs compiled {row['compiled_graphs']}, inductor"
                        f" cudagraph_skips +{row['inductor_cudagraph_skips']}, 'skipping cudagraphs' log lines"
                        f" {len(lines)}" + (f" (first: {lines[0]})" if lines else "")
                    )
                print(
                    f"  [{fmt} B={B} {mode}] {row['ms_per_token']:.2f} ms/token, {row['tokens_per_s']:.1f} tokens/s"
                    f" per sequence ({time.time() - t_mode:.0f} s){extra}",
                    flush=True,
                )
        del model
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    print_table(results, args, gpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "transformers": transformers_version(),
                    "layers": args.layers or None,
                    "tiny": args.tiny,
                    "new_tokens": args.new_tokens,
                    "prompt_len": args.prompt_len,
                    "compile_mode": args.compile_mode,
                    "fuse": args.fuse,
                    "builds": builds,
                    "results": results,
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(results, args, gpu)


def transformers_version():
    import transformers

    return transformers.__version__


def ratio_vs_bf16(results, row):
    base = [r for r in results if r["format"] == "bf16" and r["mode"] == row["mode"] and r["batch"] == row["batch"]]
    if not base or "tokens_per_s" not in base[0] or "tokens_per_s" not in row:
        return None
    return row["tokens_per_s"] / base[0]["tokens_per_s"]


def print_table(results, args, gpu, torch_version=None):
    names = {"a": "(a) generate eager", "b": "(b) generate static", "c": "(c) compiled + CUDA graph"}
    print(
        f"\ndecode, {gpu}, torch {torch_version or torch.__version__}, {args.layers or ('2' if args.tiny else '32')} layers"
        f"{' (tiny)' if args.tiny else ''}, {args.new_tokens} new tokens, tokens/s per sequence (x bf16 on the same"
        " mode and batch)\n"
    )
    cols = [(m, B) for m in args.modes for B in args.batch]
    print("| format | " + " | ".join(f"{names[m]} B={B}" for m, B in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for fmt in args.formats:
        cells = []
        for m, B in cols:
            row = next((r for r in results if r["format"] == fmt and r["mode"] == m and r["batch"] == B), None)
            if row is None or "tokens_per_s" not in row:
                cells.append("failed" if row else "-")
                continue
            ratio = ratio_vs_bf16(results, row)
            cells.append(
                f"{row['tokens_per_s']:.1f}"
                + (f" ({ratio:.2f}x)" if ratio is not None else "")
                + (" fused" if row.get("fuse") else "")
            )
        print(f"| {fmt} | " + " | ".join(cells) + " |")
    if any(r.get("fuse") for r in results):
        print("\nfused: the model ran with fuse_projections (one k-bit GEMM for q/k/v, one for gate/up)")
    compiled = [(m, B) for m, B in cols if m in ("b", "c")]
    if not compiled:
        return
    print("\ncompile checks: graph breaks / graphs compiled / 'skipping cudagraphs' lines (c: + CUDA graph used)\n")
    print("| format | " + " | ".join(f"{names[m]} B={B}" for m, B in compiled) + " |")
    print("|---|" + "---|" * len(compiled))
    for fmt in args.formats:
        cells = []
        for m, B in compiled:
            row = next((r for r in results if r["format"] == fmt and r["mode"] == m and r["batch"] == B), None)
            if row is None or "graph_breaks" not in row:
                cells.append("failed" if row else "-")
                continue
            cell = f"{row['graph_breaks']} / {row['compiled_graphs']} / {len(row['skipping_cudagraphs_lines'])}"
            if m == "c":
                cell += " / graph" if row["cuda_graph"] else " / no graph (cpu)"
            cells.append(cell)
        print(f"| {fmt} | " + " | ".join(cells) + " |")


def plot(results, args, gpu):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.batch), figsize=(5 * len(args.batch), 4), squeeze=False)
    width = 0.8 / len(args.modes)
    for ax, B in zip(axes[0], args.batch):
        for j, m in enumerate(args.modes):
            vals = []
            for fmt in args.formats:
                row = next((r for r in results if r["format"] == fmt and r["mode"] == m and r["batch"] == B), {})
                vals.append(row.get("tokens_per_s", 0.0))
            ax.bar([i + j * width for i in range(len(args.formats))], vals, width, label=f"mode {m}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(args.formats))], args.formats)
        ax.set_title(f"batch {B}")
        ax.set_ylabel("tokens/s per sequence")
        ax.legend(fontsize=7)
    fig.suptitle(f"LlamaForCausalLM decode, {gpu}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()

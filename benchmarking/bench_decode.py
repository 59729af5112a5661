"""Decode speed of a transformers LlamaForCausalLM of Llama-3-8B shape (random weights) in bf16, NF4 and k = 2..5.

    python benchmarking/bench_decode.py [--layers 32] [--formats bf16,nf4,k2,k3,k4,k5] [--modes a,b,c]
        [--batch 1,16] [--new-tokens 64] [--prompt-len 16] [--json out.json] [--plot out.png]
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
  b  model.generate(cache_implementation="static"): transformers compiles the forward itself; the log of
     torch's perf hints is captured and every "skipping cudagraphs" line is counted and printed
  c  one decode step (StaticCache, one token with cache_position, a prepared 4D attention mask, in-place updated
     input buffers, greedy argmax) captured in a torch.cuda.CUDAGraph and replayed per token; its first greedy
     tokens are compared with those of (a). Needs CUDA: on the CPU the step runs eagerly (said in the output).
tokens/s is per sequence (a batch of 16 makes 16 times as many tokens); the ratio is against bf16 on the same
mode and batch.
"""

import argparse
import inspect
import json
import logging
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
    for _ in range(repeats):
        clock = StepClock(device)
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), logits_processor=LogitsProcessorList([clock]), **kwargs
        )
        sync(device)
        per_token.append((clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1))
    return statistics.median(per_token), out[:, prompt.shape[1] :]


def cache_kwarg(model):
    """The forward's name for the cache argument (transformers 5 renames past_key_values to cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def graph_decode(model, prompt, n_new, device):
    """Mode (c): prefill eagerly into a StaticCache, then one captured CUDA graph per decode step (on the CPU the
    same step runs eagerly). Returns (seconds per new token, the generated tokens, whether a graph was used)."""
    from transformers import StaticCache

    B, P = prompt.shape
    max_len = P + n_new + 8
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    # prefill (not timed): its greedy token is the first generated one, as in generate()
    mask = torch.zeros(B, 1, 1, max_len, dtype=torch.bool, device=device)  # True = attend; prepared 4D: used as is
    prefill_mask = torch.ones(P, max_len, dtype=torch.bool, device=device).tril(0)[None, None].expand(B, 1, P, max_len)
    ck = cache_kwarg(model)
    out = model(
        prompt,
        **{ck: cache},
        cache_position=torch.arange(P, device=device),
        attention_mask=prefill_mask,
        use_cache=True,
        logits_to_keep=1,
    )
    mask[..., :P] = True
    tok = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]: the static input buffer of the step
    pos = torch.tensor([P], device=device)  # cache_position, advanced in place by the step

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

    tokens = torch.empty(B, n_new + 1, dtype=torch.long, device=device)
    tokens[:, :1] = tok
    use_graph = torch.device(device).type == "cuda"
    if use_graph:
        # warm-up on a side stream (runs the step at position P, which the first replay writes again), then capture
        state = (tok.clone(), pos.clone(), mask.clone())
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
                tok.copy_(state[0]), pos.copy_(state[1]), mask.copy_(state[2])
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        tok.copy_(state[0]), pos.copy_(state[1]), mask.copy_(state[2])
        run_step = graph.replay
    else:
        run_step = step
    sync(device)
    t0 = time.perf_counter()
    for i in range(n_new):
        run_step()
        tokens[:, i + 1 : i + 2].copy_(tok)
    sync(device)
    return (time.perf_counter() - t0) / n_new, tokens, use_graph


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


def cudagraph_skip_counter():
    """torch's own count of compiled graphs that skipped CUDA graphs (bumped with each "skipping cudagraphs")."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001  (a torch without this counter: the log lines still count)
        return 0


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
    p.add_argument("--tiny", action="store_true", help="toy widths (a check of the code paths, e.g. on the CPU)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    args.formats = parse_list(args.formats, "--formats", FORMATS)
    args.modes = parse_list(args.modes, "--modes", MODES)
    args.batch = parse_list(args.batch, "--batch", None, int)
    if min(args.batch) < 1 or args.new_tokens < 2 or args.prompt_len < 1 or args.layers < 0:
        sys.exit("bench_decode: --batch, --prompt-len >= 1, --new-tokens >= 2 and --layers >= 0 expected")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_decode: --device cuda but no CUDA GPU; use --tiny --device cpu for a CPU check")
    return args


def main(argv=None):
    args = parse_args(argv)
    skips = SkipCounter()
    if "b" in args.modes:
        try:  # torch's perf hints / cudagraphs logs carry the "skipping cudagraphs" lines; they go to stderr too
            torch._logging.set_logs(perf_hints=True, cudagraphs=True)
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
                n_skips, n_counted = len(skips.lines), cudagraph_skip_counter()
                t_mode = time.time()
                row = {"format": fmt, "mode": mode, "batch": B}
                try:
                    if mode in ("a", "b"):
                        s_tok, tokens = generate_timed(model, prompts[B], args.new_tokens, mode == "b", args.device)
                        if mode == "a":
                            ref_tokens = tokens
                    else:
                        s_tok, tokens, used = graph_decode(model, prompts[B], args.new_tokens, args.device)
                        row["cuda_graph"] = used
                        print(
                            f"  [{fmt} B={B} c] "
                            + (
                                "CUDA graph captured and replayed for every decode step"
                                if used
                                else "no CUDA device: CUDA graphs skipped, the same step ran eagerly"
                            )
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
                                    else " (bf16 rounding differs between the dynamic and the static"
                                    " cache paths; on random weights a near-tie can flip)"
                                )
                            )
                except Exception as exc:  # noqa: BLE001  (one failing cell is reported, the others still run)
                    print(f"  [{fmt} B={B} {mode}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    results.append(row)
                    continue
                row["ms_per_token"] = s_tok * 1e3
                row["tokens_per_s"] = 1.0 / s_tok
                if mode == "b":
                    row["skipping_cudagraphs_lines"] = skips.lines[n_skips:]
                    row["inductor_cudagraph_skips"] = cudagraph_skip_counter() - n_counted
                results.append(row)
                extra = ""
                if mode == "b":
                    new = skips.lines[n_skips:]
                    extra = (
                        f"; inductor cudagraph_skips counter +{row['inductor_cudagraph_skips']}, 'skipping cudagraphs'"
                        f" log lines: {len(new)}" + (f" (first: {new[0]})" if new else "")
                    )
                print(
                    f"  [{fmt} B={B} {mode}] {s_tok * 1e3:.2f} ms/token, {1 / s_tok:.1f} tokens/s per sequence"
                    f" ({time.time() - t_mode:.0f} s){extra}",
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
                    "layers": args.layers or None,
                    "tiny": args.tiny,
                    "new_tokens": args.new_tokens,
                    "prompt_len": args.prompt_len,
                    "builds": builds,
                    "results": results,
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(results, args, gpu)


def ratio_vs_bf16(results, row):
    base = [r for r in results if r["format"] == "bf16" and r["mode"] == row["mode"] and r["batch"] == row["batch"]]
    if not base or "tokens_per_s" not in base[0] or "tokens_per_s" not in row:
        return None
    return row["tokens_per_s"] / base[0]["tokens_per_s"]


def print_table(results, args, gpu):
    names = {"a": "(a) generate eager", "b": "(b) generate static", "c": "(c) CUDA graph"}
    print(
        f"\ndecode, {gpu}, {args.layers or ('2' if args.tiny else '32')} layers{' (tiny)' if args.tiny else ''}, "
        f"{args.new_tokens} new tokens, tokens/s per sequence (x bf16 on the same mode and batch)\n"
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
            cells.append(f"{row['tokens_per_s']:.1f}" + (f" ({ratio:.2f}x)" if ratio is not None else ""))
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

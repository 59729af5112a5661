"""Calibrated (error-compensating) quantization into the flat k-bit format: GPTQ with k-bit block scales.

``quantize_kbit_gptq(W, H, k)`` quantizes a linear weight W[N, K] so that the layer's output error on the
calibration inputs, tr((W - Q) H (W - Q)^T) with H = X^T X / tokens, is small, instead of the weight error
alone. Columns are quantized in order; each column's rounding error is spread over the columns not yet
quantized through the damped Cholesky factor of H^-1 (Frantar et al., GPTQ, 2022). A block's scale (one per
32 consecutive inputs of a row) is chosen with the data-free error-minimizing scale search
(``scale_search``) when the loop reaches the block's first column, from the weights as the earlier columns'
errors have left them. The result is the same (packed, absmax, codebook) that ``quantize_kbit`` returns, so
``dequantize_kbit``, ``kbit_gemm`` and ``LinearKbit`` take it unchanged.

``calibrate_model(model, texts, tokenizer, k)`` runs it over a model: it feeds calibration text through the
model, then quantizes the repeated blocks (decoder layers) in order, each from the inputs that the already
quantized earlier blocks produce, as GPTQ does. It returns the quantized weights by module name.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import functional as kbit_F
from ._ops import BLOCKSIZE
from .backends.default.ops import e4m4_table, pack_bitplanes
from .scale_search import _best_blocks, _nearest

__all__ = ["CALIBRATION_TEXT", "calibrate_model", "calibration_samples", "quantize_kbit_gptq"]

# Text shipped for calibration; disjoint from the demo's perplexity text (data/sample.txt) and the
# benchmark's sentences (benchmarking/data/sentences.txt).
CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"
_DAMP_RETRIES = 4  # Cholesky failed: damping x10, up to this many times


def _decoded(stored: torch.Tensor) -> torch.Tensor:
    """The float32 scale a stored absmax stands for (E4M4 code or float)."""
    if stored.dtype == torch.uint8:
        return e4m4_table(stored.device)[stored.long()]
    return stored.to(torch.float32)


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (U^T U = H^-1), float32. Retries with
    ten times the damping when H is too ill-conditioned for the factorization."""
    mean_diag = float(H.diagonal().mean())
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    for attempt in range(_DAMP_RETRIES + 1):
        L, info = torch.linalg.cholesky_ex(H + (damp * 10**attempt) * mean_diag * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
    raise ValueError(
        f"quantize_kbit_gptq: the Hessian is not positive definite even with damp={damp * 10**_DAMP_RETRIES:g}; "
        "pass more calibration tokens or a larger damp"
    )


def _check_gptq_args(W, H, damp, batch_columns) -> None:
    if not isinstance(W, torch.Tensor) or not isinstance(H, torch.Tensor):
        raise TypeError(
            f"quantize_kbit_gptq: W is a {type(W).__name__} and H a {type(H).__name__}; expected torch.Tensor"
        )
    if W.dim() != 2 or not W.is_floating_point() or W.numel() == 0:
        raise ValueError(
            f"quantize_kbit_gptq: W has shape {tuple(W.shape)} and dtype {W.dtype}; expected a non-empty 2-D "
            "floating-point weight [out_features, in_features]"
        )
    K = W.shape[1]
    if tuple(H.shape) != (K, K) or not H.is_floating_point():
        raise ValueError(
            f"quantize_kbit_gptq: H has shape {tuple(H.shape)} and dtype {H.dtype}; expected a floating-point "
            f"[{K}, {K}] matrix (X^T X of the layer's inputs, K = W.shape[1])"
        )
    if H.device != W.device:
        raise ValueError(f"quantize_kbit_gptq: H is on {H.device} and W on {W.device}; expected the same device")
    if not bool(torch.isfinite(W).all()) or not bool(torch.isfinite(H).all()):
        raise ValueError("quantize_kbit_gptq: W or H contains NaN or Inf; expected finite values")
    if bool((H.diagonal() < 0).any()):
        raise ValueError(
            "quantize_kbit_gptq: H has negative diagonal entries; expected X^T X (positive semi-definite)"
        )
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp > 0:
        raise ValueError(f"quantize_kbit_gptq: damp={damp!r}; expected a number > 0 (a fraction of mean(diag H))")
    if isinstance(batch_columns, bool) or not isinstance(batch_columns, int) or batch_columns < BLOCKSIZE:
        raise ValueError(f"quantize_kbit_gptq: batch_columns={batch_columns!r}; expected an int >= {BLOCKSIZE}")


@torch.no_grad()
def quantize_kbit_gptq(
    W: torch.Tensor,
    H: torch.Tensor,
    k: int = 4,
    codebook: None | str | torch.Tensor = None,
    absmax_format: str = "e4m4",
    damp: float = 0.1,
    act_order: bool = False,
    batch_columns: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a linear weight W[N, K] to k bits, compensating rounding errors through the inputs' Hessian.

    Args:
        W: the float weight [out_features, in_features]; a row is zero-padded to a multiple of 32
            (as ``ParamsKbit.quantize`` pads it), so the result is the layer's flat format.
        H: [K, K], the second moment of the layer's inputs, X^T X (any positive scale), on W's device.
            Inputs that were never active (zero diagonal) are quantized without error compensation.
        k, codebook, absmax_format: as ``quantize_kbit``.
        damp: added to H's diagonal as a fraction of its mean (GPTQ's percdamp), for a stable inverse.
        act_order: quantize the inputs in order of decreasing H diagonal (largest activations first), which
            leaves the later, less important inputs to absorb the errors. The block scales stay per 32
            consecutive inputs: each is chosen when the first of its columns is reached.
        batch_columns: columns updated together before the rest of the matrix is (speed only).

    Returns:
        (packed, absmax, codebook) as ``quantize_kbit`` of the padded W: ``dequantize_kbit(packed, absmax,
        codebook, k, N * K_padded)`` is the quantized weight. With H = identity the result is
        ``quantize_kbit(W, k, codebook, absmax_format)``'s (the "mse" scale search, nothing to compensate).
    """
    _check_gptq_args(W, H, damp, batch_columns)
    if absmax_format not in kbit_F.ABSMAX_FORMATS:
        raise ValueError(
            f"quantize_kbit_gptq: absmax_format={absmax_format!r} is not supported; expected one of "
            f"{tuple(kbit_F.ABSMAX_FORMATS)}"
        )
    cb = kbit_F.resolve_codebook(codebook, k, W.device)
    absmax_dtype = kbit_F.ABSMAX_FORMATS[absmax_format]
    limit = {"e4m4": kbit_F.E4M4_MAX, "fp16": torch.finfo(torch.float16).max}.get(absmax_format)
    if limit is not None and float(W.abs().max()) > limit:
        raise ValueError(
            f"quantize_kbit_gptq: max |W| = {float(W.abs().max()):g} exceeds the largest {absmax_format} absmax "
            f"({limit:g}); use absmax_format='fp32', or scale W down first"
        )
    N, K = W.shape
    Kp = -(-K // BLOCKSIZE) * BLOCKSIZE
    nb = Kp // BLOCKSIZE
    dev = W.device
    Wf = torch.zeros(N, Kp, dtype=torch.float32, device=dev)
    Wf[:, :K] = W
    Hf = torch.zeros(Kp, Kp, dtype=torch.float32, device=dev)
    Hf[:K, :K] = H
    diag = Hf.diagonal()
    dead = diag <= 0
    Hf[dead, :] = 0.0  # a never-active input (or padding): no coupling to the others, quantized as is
    Hf[:, dead] = 0.0
    Hf.diagonal()[dead] = float(diag[~dead].mean()) if bool((~dead).any()) else 1.0
    if act_order:
        perm = torch.argsort(Hf.diagonal(), descending=True, stable=True)
        Wf, Hf = Wf[:, perm], Hf[perm][:, perm]
    else:
        perm = torch.arange(Kp, device=dev)
    pos = torch.argsort(perm)  # pos[c]: where physical column c is processed
    U = _inverse_cholesky(Hf, damp)
    block_of = (perm // BLOCKSIZE).tolist()
    perm_list = perm.tolist()
    idx = torch.empty(N, Kp, dtype=torch.int64, device=dev)  # physical column order
    stored = torch.empty(N, nb, dtype=absmax_dtype, device=dev)
    scales = torch.zeros(N, nb, dtype=torch.float32, device=dev)
    done = [False] * nb
    for i1 in range(0, Kp, batch_columns):
        i2 = min(i1 + batch_columns, Kp)
        W1 = Wf[:, i1:i2].clone()
        Err = torch.zeros(N, i2 - i1, dtype=torch.float32, device=dev)
        U1 = U[i1:i2, i1:i2]
        for j in range(i2 - i1):
            c = i1 + j
            b = block_of[c]
            if not done[b]:
                # the block's columns as the errors so far have left them (all are at or after column c)
                cols = pos[b * BLOCKSIZE : (b + 1) * BLOCKSIZE]
                inside = cols < i2
                cur = torch.empty(N, BLOCKSIZE, dtype=torch.float32, device=dev)
                cur[:, inside] = W1[:, cols[inside] - i1]
                if not bool(inside.all()):
                    out = cols[~inside]
                    cur[:, ~inside] = Wf[:, out] - Err[:, :j] @ U[i1:c, out]
                _, st, _ = _best_blocks(cur, cb, k, absmax_dtype, True, None)
                stored[:, b] = st
                scales[:, b] = _decoded(st)
                done[b] = True
            w = W1[:, j]
            s = scales[:, b]
            q_idx = _nearest(
                torch.where(s > 0, w / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(w)), cb
            )
            idx[:, perm_list[c]] = q_idx
            err = (w - cb[q_idx] * s) / U1[j, j]
            W1[:, j + 1 :] -= err.unsqueeze(1) * U1[j, j + 1 :].unsqueeze(0)
            Err[:, j] = err
        Wf[:, i2:] -= Err @ U[i1:i2, i2:]
    packed = pack_bitplanes(idx.view(-1, BLOCKSIZE), k)
    return packed, stored.reshape(-1), cb


# ---------------------------------------------------------------------------------------- model driver


class _Captured(Exception):
    """Raised by the hook on the first block once its inputs are stored: the rest of the model need not run."""


def _progress(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        return iterable
    return tqdm(iterable, total=total, desc=desc, dynamic_ncols=True)


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, list) of the model's repeated blocks: the ``nn.ModuleList`` holding the most parameters whose
    entries (two or more) all have the same class (decoder layers of a causal LM, encoder layers of BERT)."""
    best, best_size = None, 0
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2 or len({type(m) for m in mod}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best_size:
            best, best_size = (name, mod), size
    if best is None:
        raise ValueError(
            f"calibrate_model: {type(model).__name__} has no nn.ModuleList of repeated blocks (decoder layers) to "
            "calibrate layer by layer"
        )
    return best


def calibration_samples(
    tokenizer, texts: None | str | list[str] = None, num_samples: int = 32, seq_len: int = 512
) -> list[torch.Tensor]:
    """Token ids [1, seq_len] for calibration: ``texts`` (default: the text the package ships,
    ``CALIBRATION_TEXT``) joined by blank lines and tokenized, cut into ``num_samples`` windows at evenly spaced
    starts (overlapping where the text is shorter than num_samples * seq_len; one window of the whole text if
    it is shorter than seq_len)."""
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"calibration_samples: {name}={value!r}; expected an int >= 1")
    if texts is None:
        texts = [CALIBRATION_TEXT.read_text()]
    elif isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(
            f"calibration_samples: texts={texts!r:.80}; expected None (the shipped text), a string or a non-empty "
            "list of non-empty strings"
        )
    if tokenizer is None or not callable(tokenizer):
        raise ValueError(f"calibration_samples: tokenizer={tokenizer!r}; expected a callable tokenizer")
    ids = tokenizer("\n\n".join(texts), return_tensors="pt")["input_ids"].reshape(-1)
    if ids.numel() < 2:
        raise ValueError(f"calibration_samples: the texts give {ids.numel()} tokens; expected at least 2")
    if ids.numel() <= seq_len:
        return [ids.unsqueeze(0)]
    last = ids.numel() - seq_len
    starts = sorted({round(i * last / max(num_samples - 1, 1)) for i in range(num_samples)})
    return [ids[s : s + seq_len].unsqueeze(0) for s in starts]


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _with_hidden(args: tuple, kwargs: dict, h: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (h, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": h}


def _block_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def calibrate_model(
    model: nn.Module,
    k: int = 4,
    *,
    tokenizer=None,
    texts: None | str | list[str] = None,
    samples: list[torch.Tensor] | None = None,
    num_samples: int = 32,
    seq_len: int = 512,
    codebook: None | str | torch.Tensor = None,
    absmax_format: str = "e4m4",
    damp: float = 0.1,
    act_order: bool = True,
    modules: list[str] | None = None,
    progress: bool = True,
) -> dict:
    """GPTQ-quantize the linear layers of ``model``'s repeated blocks, block by block, on the model's device.

    Args:
        model: a float model whose forward takes token ids (``model(input_ids)``: transformers models).
        k, codebook, absmax_format, damp, act_order: as ``quantize_kbit_gptq``.
        tokenizer, texts, num_samples, seq_len: the calibration inputs, as ``calibration_samples`` makes them
            (``texts`` None: the shipped text). Or ``samples``: token id tensors [1, L], used as given.
        modules: names of the ``nn.Linear`` modules to quantize (default: every one inside the blocks).
            Those outside the blocks are left to the caller (they get no calibration inputs).
        progress: a tqdm bar over the blocks.

    Returns:
        {module name: ``ParamsKbit``}, the flat format of each quantized weight. The model's float weights are
        replaced by their dequantized values as it goes (each block's inputs come from the quantized blocks
        before it), so afterwards the model computes what the k-bit model will.
    """
    from .nn.modules import ParamsKbit

    if samples is None:
        samples = calibration_samples(tokenizer, texts, num_samples, seq_len)
    if not samples or not all(isinstance(s, torch.Tensor) and s.dim() == 2 and s.shape[1] >= 1 for s in samples):
        raise ValueError("calibrate_model: samples must be a non-empty list of token id tensors [batch, length]")
    blocks_name, blocks = find_blocks(model)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    if modules is None:
        wanted = {n for n in linears if n.startswith(blocks_name + ".")}
    else:
        unknown = sorted(set(modules) - set(linears))
        if unknown:
            raise ValueError(f"calibrate_model: modules {unknown[:5]} are not nn.Linear modules of the model")
        wanted = set(modules)
    device = next(model.parameters()).device

    # the first block's inputs, one (args, kwargs) per sample
    inputs = []

    def capture(_module, args, kwargs):
        kwargs = {key: v for key, v in kwargs.items() if key not in ("past_key_values", "past_key_value")}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        inputs.append((args, kwargs))
        raise _Captured

    was_training = model.training
    model.eval()
    use_cache = getattr(getattr(model, "config", None), "use_cache", None)
    if use_cache is not None:
        model.config.use_cache = False
    handle = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for ids in samples:
            try:
                model(ids.to(device))
            except _Captured:
                pass
    finally:
        handle.remove()
        if use_cache is not None:
            model.config.use_cache = use_cache
    if len(inputs) != len(samples):
        raise RuntimeError(f"calibrate_model: the model did not reach its first block ({blocks_name}.0)")

    result = {}
    for i, block in _progress(enumerate(blocks), len(blocks), f"GPTQ k={k}", progress):
        prefix = f"{blocks_name}.{i}."
        todo = {n: linears[n] for n in sorted(wanted) if n.startswith(prefix)}
        stats, hooks = {}, []  # name -> [sum of x x^T (float32), tokens]
        for name, lin in todo.items():
            H0 = torch.zeros(lin.in_features, lin.in_features, dtype=torch.float32, device=lin.weight.device)
            stats[name] = [H0, 0]

            def accumulate(_m, args, _out, stat=stats[name]):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to(stat[0].device, torch.float32)
                stat[0].addmm_(x.t(), x)
                stat[1] += x.shape[0]

            hooks.append(lin.register_forward_hook(accumulate))
        try:
            for args, kwargs in inputs:
                block(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        for name, lin in todo.items():
            H_sum, tokens = stats.pop(name)
            H = H_sum / max(tokens, 1)
            packed, absmax, cb = quantize_kbit_gptq(
                lin.weight.detach(), H, k, codebook, absmax_format=absmax_format, damp=damp, act_order=act_order
            )
            params = ParamsKbit(packed, absmax, cb, k, lin.out_features, lin.in_features)
            lin.weight.data.copy_(params.dequantize(torch.float32).to(lin.weight.dtype))
            result[name] = params
        inputs = [_with_hidden(a, kw, _block_output(block(*a, **kw))) for a, kw in inputs]
    if was_training:
        model.train()
    return result

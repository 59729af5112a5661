"""GPTQ-style calibrated quantization (bitsandbytes_kbit.calibration) against an independent float64 reference.

The reference below quantizes column by column with the explicit inverse Hessian, removing each quantized
column from it by a Schur complement (the OBQ update), instead of the implementation's batched Cholesky
factor; block scales come from the data-free ``quantize_kbit`` of the block's current weights; rounding is
an argmin over the levels.
"""

import copy

import pytest
import torch
from conftest import requires_cuda, tiny_llama
from torch import nn

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.calibration import calibrate_model, calibration_samples, find_blocks, quantize_kbit_gptq
from bitsandbytes_kbit.nn import LinearKbit, ParamsKbit


def correlated_inputs(K: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs with correlated features and unequal scales (as real activations have), [tokens, K]."""
    mix = torch.randn(K, K, generator=gen) / K**0.5 + 0.3 * torch.eye(K)
    return (torch.randn(tokens, K, generator=gen) @ mix) * (0.2 + 3 * torch.rand(K, generator=gen))


def reference_gptq(W, H, k, codebook, damp, act_order, absmax_format="e4m4"):
    """The dequantized GPTQ weight [N, K] (float64), K a multiple of 32."""
    K = W.shape[1]
    W = W.double().clone()
    H = H.double().clone()
    H += damp * H.diagonal().mean() * torch.eye(K, dtype=torch.float64)
    order = torch.argsort(H.diagonal(), descending=True, stable=True).tolist() if act_order else list(range(K))
    cb = F.resolve_codebook(codebook, k, "cpu").double()
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    scale = {}
    remaining = list(range(K))
    for c in order:
        b = c // 32
        if b not in scale:
            _, absmax, _ = F.quantize_kbit(W[:, 32 * b : 32 * b + 32].float().contiguous(), k, codebook, absmax_format)
            scale[b] = (F.decode_absmax_e4m4(absmax) if absmax.dtype == torch.uint8 else absmax.float()).double()
        s = scale[b]
        x = torch.where(s > 0, W[:, c] / torch.where(s > 0, s, 1.0), 0.0)
        q = cb[(x.unsqueeze(1) - cb).abs().argmin(dim=1)] * s
        Q[:, c] = q
        remaining.remove(c)
        err = (W[:, c] - q) / Hinv[c, c]
        W[:, remaining] -= err.unsqueeze(1) * Hinv[c, remaining].unsqueeze(0)
        Hinv = Hinv - torch.outer(Hinv[:, c], Hinv[c, :]) / Hinv[c, c]
    return Q


def dequant(packed, absmax, cb, k, N, K):
    Kp = -(-K // 32) * 32
    return F.dequantize_kbit(packed, absmax, cb, k, N * Kp, dtype=torch.float32).view(N, Kp)[:, :K]


def h_error(W, Q, H):
    D = (W - Q).double()
    return float(torch.einsum("nk,kl,nl->", D, H.double(), D))


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_matches_reference(k, act_order):
    gen = torch.Generator().manual_seed(100 + k)
    N, K = 48, 96
    W = torch.randn(N, K, generator=gen) * 0.05
    X = correlated_inputs(K, 2048, gen)
    H = X.t() @ X / X.shape[0]
    packed, absmax, cb = quantize_kbit_gptq(W, H, k, damp=0.01, act_order=act_order, batch_columns=64)
    Q = dequant(packed, absmax, cb, k, N, K)
    Q_ref = reference_gptq(W, H, k, None, 0.01, act_order).float()
    # float32 against float64: a rare rounding may differ (and shift the rest of its row a little)
    assert (Q == Q_ref).float().mean() > 0.97
    e, e_ref = h_error(W, Q, H), h_error(W, Q_ref, H)
    assert abs(e - e_ref) <= 0.03 * e_ref


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("absmax_format", ["e4m4", "fp16", "fp32"])
def test_identity_hessian_is_the_data_free_quantizer(k, absmax_format):
    gen = torch.Generator().manual_seed(k)
    N, K = 24, 80  # K not a multiple of 32: padded as ParamsKbit pads
    W = torch.randn(N, K, generator=gen) * 0.1
    packed, absmax, cb = quantize_kbit_gptq(W, torch.eye(K), k, absmax_format=absmax_format)
    W_pad = torch.nn.functional.pad(W, (0, 16))
    packed_ref, absmax_ref, cb_ref = F.quantize_kbit(W_pad, k, absmax_format=absmax_format)
    assert torch.equal(packed, packed_ref) and torch.equal(absmax, absmax_ref) and torch.equal(cb, cb_ref)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_gptq_error_under_h_below_data_free(k):
    gen = torch.Generator().manual_seed(7 + k)
    N, K = 64, 128
    W = torch.randn(N, K, generator=gen) * 0.02
    X = correlated_inputs(K, 4096, gen)
    H = X.t() @ X / X.shape[0]
    W_df = ParamsKbit.quantize(W, k).dequantize()
    base = h_error(W, W_df, H)
    for act_order in (False, True):
        Q = dequant(*quantize_kbit_gptq(W, H, k, act_order=act_order), k, N, K)
        assert h_error(W, Q, H) < 0.85 * base
    # and so the output error on those inputs
    Y = X[:512] @ W.t()
    assert float(((X[:512] @ Q.t() - Y) ** 2).sum()) < float(((X[:512] @ W_df.t() - Y) ** 2).sum())


def test_codebook_tensor_and_zero_rows():
    gen = torch.Generator().manual_seed(3)
    N, K = 16, 64
    W = torch.randn(N, K, generator=gen)
    W[3] = 0.0  # an all-zero row: scale 0, every index the level nearest 0
    X = correlated_inputs(K, 512, gen)
    X[:, 5] = 0.0  # a never-active input
    H = X.t() @ X
    levels = torch.tensor([0.5, -1.0, 0.0, 1.0, -0.25])
    packed, absmax, cb = quantize_kbit_gptq(W, H, 3, codebook=levels, act_order=True, damp=0.01)
    assert torch.equal(cb, torch.sort(levels).values)
    Q = dequant(packed, absmax, cb, 3, N, K)
    assert torch.equal(Q[3], torch.zeros(K))
    Q_ref = reference_gptq(
        W, H + torch.diag((H.diagonal() == 0).double() * H.diagonal().mean()), 3, levels, 0.01, True
    )
    assert (Q == Q_ref.float()).float().mean() > 0.97


def test_result_loads_into_linear_kbit():
    gen = torch.Generator().manual_seed(11)
    lin = nn.Linear(72, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 72, generator=gen) * 0.05)
    X = correlated_inputs(72, 1024, gen)
    packed, absmax, cb = quantize_kbit_gptq(lin.weight, X.t() @ X, 3)
    params = ParamsKbit(packed, absmax, cb, 3, 40, 72)
    layer = LinearKbit.empty_quantized(72, 40, k=3, device="cpu")
    layer.set_quant_params(params)
    layer.check_format()
    x = torch.randn(5, 72, generator=gen)
    W_q = dequant(packed, absmax, cb, 3, 40, 72)
    torch.testing.assert_close(layer(x) - layer.bias, x @ W_q.t(), rtol=1e-5, atol=1e-5)
    state = layer.state_dict()
    again = LinearKbit.empty_quantized(72, 40, k=3, device="cpu")
    again.load_state_dict(state)
    torch.testing.assert_close(again(x), layer(x))


def test_bad_arguments():
    W, H = torch.randn(8, 32), torch.eye(32)
    with pytest.raises(ValueError, match=r"H has shape \(16, 16\)"):
        quantize_kbit_gptq(W, torch.eye(16), 3)
    with pytest.raises(ValueError, match="W has shape"):
        quantize_kbit_gptq(W.reshape(-1), H, 3)
    with pytest.raises(ValueError, match="damp=0"):
        quantize_kbit_gptq(W, H, 3, damp=0)
    with pytest.raises(ValueError, match="batch_columns=8"):
        quantize_kbit_gptq(W, H, 3, batch_columns=8)
    with pytest.raises(ValueError, match="absmax_format='e5m2'"):
        quantize_kbit_gptq(W, H, 3, absmax_format="e5m2")
    with pytest.raises(RuntimeError, match="k=6"):
        quantize_kbit_gptq(W, H, 6)
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_kbit_gptq(W, H * float("nan"), 3)
    with pytest.raises(ValueError, match="not positive definite"):
        quantize_kbit_gptq(W, 2 * torch.ones(32, 32) - torch.eye(32), 3, damp=1e-12)  # eigenvalues 63 and -1
    with pytest.raises(ValueError, match="negative diagonal"):
        quantize_kbit_gptq(W, -torch.eye(32), 3)


class CharTokenizer:
    """A stand-in tokenizer: one id per character (no downloads)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, return_tensors=None):
        return {"input_ids": torch.tensor([[ord(c) % self.vocab for c in text]])}


def test_calibration_samples():
    tok = CharTokenizer(128)
    s = calibration_samples(tok, num_samples=4, seq_len=64)
    assert len(s) == 4 and all(t.shape == (1, 64) for t in s)
    text = "abcdefghij" * 10
    s = calibration_samples(tok, [text], num_samples=3, seq_len=40)
    assert [t[0, 0].item() for t in s] == [ord(text[i]) for i in (0, 30, 60)]
    assert len(calibration_samples(tok, "short", num_samples=8, seq_len=64)) == 1
    with pytest.raises(ValueError, match="num_samples=0"):
        calibration_samples(tok, num_samples=0)
    with pytest.raises(ValueError, match="texts="):
        calibration_samples(tok, ["", "x"])
    with pytest.raises(ValueError, match="tokenizer=None"):
        calibration_samples(None)


def hessian_of(model, module_name, samples):
    """X^T X / tokens of a linear's inputs, from a plain forward of the whole model."""
    xs = []
    handle = model.get_submodule(module_name).register_forward_hook(
        lambda m, a, o: xs.append(a[0].reshape(-1, a[0].shape[-1]))
    )
    with torch.no_grad():
        for s in samples:
            model(s)
    handle.remove()
    X = torch.cat(xs).double()
    return (X.t() @ X / X.shape[0]).float()


def test_calibrate_model_layer_by_layer():
    model = tiny_llama(seed=1)
    original = copy.deepcopy(model)
    tok = CharTokenizer(model.config.vocab_size)
    samples = calibration_samples(tok, num_samples=6, seq_len=48)
    k = 3
    result = calibrate_model(model, k, samples=samples, progress=False)
    assert find_blocks(model)[0] == "model.layers"
    expected = sorted(n for n, m in original.named_modules() if type(m) is nn.Linear and n.startswith("model.layers."))
    assert sorted(result) == expected and len(expected) == 14
    # the model now holds the dequantized weights
    for n, p in result.items():
        assert torch.equal(model.get_submodule(n).weight, p.dequantize())
    # layer 0 from the float model's inputs; layer 1 from inputs through the quantized layer 0
    for n in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        H = hessian_of(original, n, samples)
        W = original.get_submodule(n).weight
        Q = dequant(*quantize_kbit_gptq(W, H, k, act_order=True), k, *W.shape)
        assert (Q == result[n].dequantize()).float().mean() > 0.97
    half = copy.deepcopy(original)
    for n in expected:
        if n.startswith("model.layers.0."):
            half.get_submodule(n).weight.data.copy_(result[n].dequantize())
    for n in ("model.layers.1.self_attn.k_proj", "model.layers.1.mlp.up_proj"):
        H = hessian_of(half, n, samples)
        W = original.get_submodule(n).weight
        Q = dequant(*quantize_kbit_gptq(W, H, k, act_order=True), k, *W.shape)
        assert (Q == result[n].dequantize()).float().mean() > 0.97
    with pytest.raises(ValueError, match="not nn.Linear"):
        calibrate_model(original, k, samples=samples, modules=["model.embed_tokens"], progress=False)


def test_calibrated_model_beats_data_free_on_its_inputs():
    """On the calibration inputs themselves the calibrated model's logits are closer to the float model's."""
    model = tiny_llama(seed=2)
    ref = copy.deepcopy(model)
    data_free = copy.deepcopy(model)
    samples = calibration_samples(CharTokenizer(model.config.vocab_size), num_samples=8, seq_len=48)
    calibrate_model(model, 2, samples=samples, progress=False)
    for n, m in data_free.named_modules():
        if type(m) is nn.Linear and n.startswith("model.layers."):
            m.weight.data.copy_(ParamsKbit.quantize(m.weight, 2).dequantize())
    with torch.no_grad():
        errs = [
            sum(float(((mdl(s).logits - ref(s).logits) ** 2).sum()) for s in samples) for mdl in (model, data_free)
        ]
    assert errs[0] < errs[1]


@pytest.mark.cuda
@requires_cuda
def test_cuda_gptq_matches_cpu():
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(128, 256, generator=gen) * 0.02
    X = correlated_inputs(256, 4096, gen)
    H = X.t() @ X / X.shape[0]
    cpu = dequant(*quantize_kbit_gptq(W, H, 3, act_order=True), 3, 128, 256)
    gpu = dequant(*quantize_kbit_gptq(W.cuda(), H.cuda(), 3, act_order=True), 3, 128, 256).cpu()
    assert (cpu == gpu).float().mean() > 0.97
    assert abs(h_error(W, gpu, H) - h_error(W, cpu, H)) <= 0.03 * h_error(W, cpu, H)

"""fuse_projections: sibling k-bit projections (q/k/v, gate/up) served by one GEMM per group. On the CPU the layers
run the fused kbit_gemm op on their repacked weights (fused_device_types includes "cpu"), the path CUDA takes.

Reference: the same model unfused. A group's GEMM computes every output column from the same weight and input as the
member's own GEMM; the tolerance covers a backend that blocks the wider product differently (float32 sums)."""

import pytest
import torch
from conftest import run_threads, seeded, tiny_llama
from torch import nn

from bitsandbytes_kbit.nn import LinearKbit, fuse_projections


def _kbit_llama(k=4, seed=0, device="cpu", dtype=torch.bfloat16):
    model = tiny_llama(seed=seed).to(device, dtype)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name != "lm_head":
            q = LinearKbit.from_linear(module, k=k)
            q.fused_device_types = ("cpu", "cuda")
            model.set_submodule(name, q.prepare_for_inference())
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _assert_close(a, b):
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 4 * 2**-8 * scale, (a - b).abs().max().item()


def test_fused_model_matches_the_unfused_one_and_keeps_its_state_dict():
    model, ref = _kbit_llama(seed=1), _kbit_llama(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) == 2 * len(model.model.layers)  # q/k/v and gate/up of every layer
    attn = model.model.layers[0].self_attn
    assert attn.q_proj._fused is attn.k_proj._fused is attn.v_proj._fused is not None
    # members' tensors are views of the group's: one copy of the weights
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    ids = torch.randint(1, 128, (2, 7), generator=seeded("fuse", 1))
    _assert_close(_logits(model, ids), _logits(ref, ids))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_members_called_alone_or_on_other_inputs_are_correct():
    model, ref = _kbit_llama(seed=2), _kbit_llama(seed=2)
    fuse_projections(model)
    attn, attn_ref = model.model.layers[1].self_attn, ref.model.layers[1].self_attn
    g = seeded("fuse-alone")
    x, other = (torch.randn(3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        # k alone twice, then v on another tensor (cross-attention), then q: each equals its own layer's product
        for layer, inp in (("k_proj", x), ("k_proj", x), ("v_proj", other), ("q_proj", x), ("v_proj", x)):
            got, want = getattr(attn, layer)(inp), getattr(attn_ref, layer)(inp)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_group_dissolves_when_a_member_changes():
    model = _kbit_llama(seed=3)
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    state = {k: v.clone() for k, v in mlp.up_proj.state_dict().items()}
    mlp.up_proj.load_state_dict(state)
    assert mlp.gate_proj._fused is None and mlp.up_proj._fused is None
    ref = _kbit_llama(seed=3)
    ids = torch.randint(1, 128, (1, 5), generator=seeded("fuse-dissolve"))
    _assert_close(_logits(model, ids), _logits(ref, ids))
    assert fuse_projections(model) == 1 and mlp.up_proj._fused is not None  # the MLP fuses again, the rest stays
    _assert_close(_logits(model, ids), _logits(ref, ids))


def test_unfusable_groups_are_left_alone():
    model = _kbit_llama(seed=4)
    attn = model.model.layers[0].self_attn
    attn.v_proj = LinearKbit.from_linear(nn.Linear(64, 32, bias=False).to(torch.bfloat16), k=3)  # another k
    attn.v_proj.fused_device_types = ("cpu",)
    attn.v_proj.prepare_for_inference()
    model.model.layers[1].mlp.up_proj.fused_device_types = ("cuda",)  # flat on the CPU: no fused kernel here
    assert fuse_projections(model) == 2 * len(model.model.layers) - 2
    assert attn.q_proj._fused is None and model.model.layers[1].mlp.gate_proj._fused is None


def test_grad_and_float32_inputs_take_the_layers_one_by_one():
    model = _kbit_llama(seed=5)
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 64, generator=seeded("fuse-grad")).to(torch.bfloat16).requires_grad_()
    y = attn.q_proj(x)
    y.float().sum().backward()
    assert x.grad is not None and attn.q_proj._fused.state is None  # the group was not used
    # float32 compute runs without the fused kernel: the layer stores its weight flat again and leaves the group
    ref = _kbit_llama(seed=5).model.layers[0].self_attn
    with torch.no_grad():
        got = attn.k_proj(x.detach().float())
        torch.testing.assert_close(got, ref.k_proj(x.detach().float()), rtol=1e-5, atol=1e-5)
    assert attn.q_proj._fused is None and attn.k_proj._fused is None


def test_fused_decoder_compiles_in_one_graph():
    model, ref = _kbit_llama(seed=6), _kbit_llama(seed=6)
    fuse_projections(model)
    ids = torch.randint(1, 128, (2, 6), generator=seeded("fuse-compile"))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for _ in range(2):
            _assert_close(compiled(ids).logits.float(), _logits(ref, ids))
    group = model.model.layers[0].self_attn.q_proj._fused
    assert group.state is None  # nothing of the traced call kept alive
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("k", [2, 4])
def test_cuda_fused_model_matches_the_unfused_one(k):
    model, ref = _kbit_llama(k, seed=7, device="cuda"), _kbit_llama(k, seed=7, device="cuda")
    assert fuse_projections(model) == 2 * len(model.model.layers)
    ids = torch.randint(1, 128, (3, 9), generator=seeded("fuse-cuda", k)).cuda()
    _assert_close(_logits(model, ids), _logits(ref, ids))


def test_threads_sharing_a_fused_model_get_their_own_results():
    model, ref = _kbit_llama(seed=8), _kbit_llama(seed=8)
    fuse_projections(model)
    inputs = [torch.randint(1, 128, (1, 3 + t), generator=seeded("fuse-threads", t)) for t in range(4)]
    expected = [_logits(ref, ids) for ids in inputs]

    def run(t):
        for _ in range(10):
            _assert_close(_logits(model, inputs[t]), expected[t])

    run_threads(run, 4)


class _Attention(nn.Module):
    def __init__(self, rows, bias, k=4, seed=0):
        super().__init__()
        g = seeded("fuse-attn", *rows, bias, seed)
        for name, n in zip(("q_proj", "k_proj", "v_proj"), rows):
            lin = nn.Linear(96, n, bias=bias)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(n, 96, generator=g) * 0.1)
                if bias:
                    lin.bias.copy_(torch.randn(n, generator=g))
            layer = LinearKbit.from_linear(lin, k=k)
            layer.fused_device_types = ("cpu",)
            setattr(self, name, layer.prepare_for_inference())

    def forward(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)


@pytest.mark.parametrize("rows", [(64, 32, 40), (48, 16, 8)], ids=["last-off-16", "small"])
def test_biases_and_a_last_layer_off_the_16_row_tile(rows):
    """Biases are concatenated with the rows; the last layer may end off a 16-row tile (its padding rows follow it)."""
    module, ref = _Attention(rows, True, seed=1), _Attention(rows, True, seed=1)
    assert fuse_projections(module) == 1
    x = torch.randn(5, 96, generator=seeded("fuse-bias", *rows)).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(module(x).float(), ref(x).float(), rtol=2e-2, atol=2e-2)


def test_a_middle_layer_off_the_16_row_tile_is_not_fused():
    module = _Attention((64, 40, 32), False)
    assert fuse_projections(module) == 0 and module.q_proj._fused is None


def test_a_bias_that_requires_grad_gets_its_gradient():
    """With grad mode on, a member whose bias requires grad takes its own path (the group's concatenated bias
    records no autograd): the bias gets its gradient; under no_grad the group serves it."""
    module = _Attention((32, 16, 16), True, seed=2)
    fuse_projections(module)
    x = torch.randn(3, 96, generator=seeded("fuse-bias-grad")).to(torch.bfloat16)
    module(x).float().sum().backward()
    assert all(getattr(module, n).bias.grad is not None for n in ("q_proj", "k_proj", "v_proj"))
    assert module.q_proj._fused is not None
    with torch.no_grad():
        y = module.q_proj(x)
    assert module.q_proj._fused.state is not None and module.q_proj._fused.state[0] is x
    assert y.shape == (3, 32)

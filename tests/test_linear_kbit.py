"""LinearKbit: forward against the default backend's dequantized weight, state_dict round trips,
the dtype guard, autograd, and torch.compile without graph breaks.

Reference (STYLE.md section 10): the weight the module holds, dequantized by the default backend
in float32 (``ParamsKbit.dequantize``), multiplied in float64 with the input and bias as the module
feeds them to kbit_gemm (both in the compute dtype). So the comparisons measure the
module's arithmetic, not quantization error.

Tolerance: the module accumulates in float32 and rounds once to the output dtype, so
|y - y_ref| <= eps_out / 2 * |y_ref| + K * eps_fp32 * (|x| @ |W|^T) (the float32 dot-product
bound, Higham 3.1, with K the padded length). We assert with eps_out (twice the rounding term).
"""

import io

import pytest
import torch
from conftest import seeded
from torch import nn

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.nn import KBIT_FORMAT_VERSION, LinearKbit, ParamsKbit

K_BITS = (2, 3, 4, 5)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def make_linear(in_features, out_features, bias, *seed, dtype=torch.float32):
    g = seeded("linear", in_features, out_features, bias, *seed)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(out_features, generator=g) * 0.1)
    return lin.to(dtype)


def reference(module: LinearKbit, x: torch.Tensor) -> torch.Tensor:
    W = module.dequantize(torch.float32).double()
    y = x.double() @ W.t()
    if module.bias is not None:
        y = y + module.bias.to(x.dtype).double()  # kbit_gemm takes the bias in the compute dtype
    return y


def assert_close_to_reference(y, module, x):
    """The bound of the module docstring, with x as the module saw it (in the compute dtype)."""
    y_ref = reference(module, x)
    W = module.dequantize(torch.float32).double()
    K = module.padded_in_features
    bound = torch.finfo(y.dtype).eps * y_ref.abs() + K * torch.finfo(torch.float32).eps * (
        x.double().abs() @ W.abs().t()
    )
    err = (y.double() - y_ref).abs()
    assert bool((err <= bound + 1e-30).all()), f"max error {err.max():.3g}, max excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("in_features", [64, 70, 13], ids=lambda v: f"K{v}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("k", K_BITS, ids=lambda v: f"k{v}")
def test_forward_matches_dequantized_reference(k, dtype, in_features, bias):
    lin = make_linear(in_features, 48, bias, k)
    module = LinearKbit.from_linear(lin, k=k)
    assert module.is_quantized and module.weight.dtype == torch.int32
    assert module.padded_in_features == -(-in_features // 32) * 32
    x = torch.randn(3, 5, in_features, generator=seeded("x", k, dtype, in_features, bias)).to(dtype)
    y = module(x)
    assert y.shape == (3, 5, 48) and y.dtype == dtype
    assert_close_to_reference(y, module, x)


@pytest.mark.parametrize("k", K_BITS, ids=lambda v: f"k{v}")
def test_quantization_error_is_bounded_by_k(k):
    """Scale-free sanity check of what the module holds: relative Frobenius error of the weight."""
    lin = make_linear(256, 64, False, "nmse", k)
    module = LinearKbit.from_linear(lin, k=k)
    err = (module.dequantize() - lin.weight).norm() / lin.weight.norm()
    # NF codebooks on Gaussian data: about 0.34, 0.18, 0.095, 0.05 for k = 2..5 (+ E4M4 absmax rounding).
    assert err < {2: 0.45, 3: 0.25, 4: 0.13, 5: 0.07}[k]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("k", K_BITS, ids=lambda v: f"k{v}")
def test_fused_path_equals_flat_path(k, dtype):
    """The fused path (repack + kbit_gemm, here through the default backend on the CPU) and the flat
    path compute the same float32 arithmetic: bit-identical outputs, and identical to calling
    kbit_gemm directly on repack_kbit's output."""
    lin = make_linear(70, 40, True, "fused", k)
    module = LinearKbit.from_linear(lin, k=k)
    x = torch.randn(7, 70, generator=seeded("fused-x", k, dtype)).to(dtype)
    y_flat = module(x)
    module.fused_device_types = ("cpu",)
    y_fused = module(x)
    assert torch.equal(y_flat, y_fused)
    params = module.quant_params  # the flat words, whatever the storage layout
    B_packed, B_absmax = F.repack_kbit(params.packed, params.absmax, k, 40, 96)
    x_pad = torch.nn.functional.pad(x, (0, 26))
    y_op = F.kbit_gemm(x_pad, B_packed, B_absmax, module.codebook, k, 40, 96, bias=module.bias.to(dtype))
    assert torch.equal(y_op, y_fused)


def test_one_copy_repacked_in_place_and_saved_flat():
    """On a fused device the weight is repacked in place once (the flat words are freed: one copy of
    the packed weight), the state dict stays in the flat format bit for bit, the flat path converts
    back, and a load starts from the flat format again."""
    module = LinearKbit.from_linear(make_linear(64, 32, True, "cache"), k=4)
    flat_state = {key: value.clone() for key, value in module.state_dict().items()}
    module.fused_device_types = ("cpu",)
    assert module._tiled is False
    x = torch.randn(2, 64, generator=seeded("cache-x")).half()
    y = module(x)
    param = module.weight
    assert module._tiled is True and module.weight.dim() == 2  # the repacked layout, [units, words]
    assert module(x).equal(y) and module.weight is param  # converted once; the Parameter object is kept
    int_bytes = sum(
        t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()] if t.dtype == torch.int32
    )
    assert int_bytes == module.weight.numel() * 4 + module.kbit_format.numel() * 4  # no second packed copy
    saved = module.state_dict()
    assert set(saved) == set(flat_state) and all(torch.equal(saved[key], flat_state[key]) for key in saved)
    assert torch.equal(
        module.dequantize(torch.float32),
        LinearKbit.from_linear(make_linear(64, 32, True, "cache"), k=4).dequantize(torch.float32),
    )
    module.fused_device_types = ()
    assert torch.equal(module(x), y) and module._tiled is False  # the flat path: back to the flat words
    assert torch.equal(module.weight, flat_state["weight"])
    module.fused_device_types = ("cpu",)
    module(x)
    module.load_state_dict({}, strict=False)  # a partial load (PEFT loading adapters) keeps the layout
    assert module._tiled is True and torch.equal(module(x), y)
    module.load_state_dict(flat_state)
    assert module._tiled is False and torch.equal(module.weight, flat_state["weight"])  # a load is flat


def test_identity_input_returns_the_dequantized_weight():
    module = LinearKbit.from_linear(make_linear(96, 24, False, "eye"), k=3)
    y = module(torch.eye(96))
    assert torch.equal(y, module.dequantize(torch.float32).t())


@pytest.mark.parametrize("codebook", ["nf", "uniform", "fp4", "tensor"])
def test_codebooks(codebook):
    k = 4
    cb = torch.linspace(-1, 1, 9) if codebook == "tensor" else codebook
    module = LinearKbit.from_linear(make_linear(64, 16, True, codebook), k=k, codebook=cb)
    expected = F.resolve_codebook(cb, k, "cpu")
    assert torch.equal(module.codebook, expected)
    x = torch.randn(4, 64, generator=seeded("cb", codebook))
    assert_close_to_reference(module(x), module, x)


def test_state_dict_round_trip_is_bit_identical():
    lin = make_linear(70, 48, True, "sd")
    module = LinearKbit.from_linear(lin, k=5)
    sd = module.state_dict()
    assert set(sd) == {"weight", "bias", "absmax", "codebook", "kbit_format"}
    assert sd["weight"].dtype == torch.int32 and sd["weight"].shape == (48 * 96 // 32 * 5,)
    assert sd["absmax"].dtype == torch.uint8 and sd["codebook"].dtype == torch.float32
    assert sd["kbit_format"].tolist() == [KBIT_FORMAT_VERSION, 5, 48, 70, 96]
    assert sd["weight"].shape != lin.weight.shape  # a float nn.Linear can never load it silently

    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    # Into a fresh float module with another k (k comes from the state), and into an empty quantized one.
    for target in (LinearKbit(70, 48, k=2), LinearKbit.empty_quantized(70, 48, k=5, device="cpu")):
        target.load_state_dict(loaded)
        assert target.k == 5 and target.is_quantized
        for key, value in target.state_dict().items():
            assert value.dtype == sd[key].dtype and torch.equal(value, sd[key]), key
        x = torch.randn(3, 70, generator=seeded("sd-x")).bfloat16()
        assert torch.equal(target(x), module(x))

    with pytest.raises(RuntimeError, match="size mismatch"):
        lin.load_state_dict(sd, strict=False)
    with pytest.raises(RuntimeError, match=r"stored weight has shape \(48, 70\)"):
        LinearKbit(64, 48).load_state_dict(sd)
    newer = dict(sd, kbit_format=torch.tensor([KBIT_FORMAT_VERSION + 1, 5, 48, 70, 96], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="format version"):
        LinearKbit(70, 48).load_state_dict(newer)


def test_load_into_meta_module_with_assign():
    module = LinearKbit.from_linear(make_linear(64, 32, True, "meta"), k=4)
    target = LinearKbit.empty_quantized(64, 32, k=4, device="meta")
    assert target.weight.shape == module.weight.shape and target.weight.dtype == torch.int32
    target.load_state_dict(module.state_dict(), assign=True)
    target.check_format()
    x = torch.randn(2, 64, generator=seeded("meta-x"))
    assert torch.equal(target(x), module(x))


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.float(),
        lambda m: m.double(),
        lambda m: m.to(torch.float16),
        lambda m: m.to("cpu", torch.bfloat16),
        lambda m: m.type(torch.float64),
    ],
    ids=["half", "bfloat16", "float", "double", "to-fp16", "to-cpu-bf16", "type-fp64"],
)
def test_dtype_casts_never_touch_the_quantized_state(cast):
    module = LinearKbit.from_linear(make_linear(64, 32, True, "guard"), k=3)
    before = {name: t.clone() for name, t in module.state_dict().items() if name != "bias"}
    wrapper = nn.Sequential(module)
    cast(wrapper)
    after = module.state_dict()
    for name, value in before.items():
        assert after[name].dtype == value.dtype, name
        assert torch.equal(after[name], value), name
    assert module.bias.dtype == next(iter(cast(nn.Linear(1, 1)).parameters())).dtype  # the bias is cast as usual
    x = torch.randn(2, 64, generator=seeded("guard-x")).to(module.bias.dtype)
    y = module(x)
    assert y.dtype == x.dtype
    ref = LinearKbit.from_linear(make_linear(64, 32, True, "guard"), k=3)
    assert torch.equal(ref.weight, module.weight)


def test_compute_dtype_and_output_dtype():
    lin = make_linear(64, 32, True, "cd")
    module = LinearKbit.from_linear(lin, k=4, compute_dtype=torch.bfloat16)
    x = torch.randn(5, 64, generator=seeded("cd-x"))
    y = module(x)
    assert y.dtype == torch.float32
    # What the module computes: x rounded to bfloat16, float32 accumulation, rounded to bfloat16.
    assert_close_to_reference(y.bfloat16(), module, x.bfloat16())
    with pytest.raises(RuntimeError, match=r"compute_dtype=torch.int8"):
        LinearKbit(64, 32, compute_dtype=torch.int8)
    with pytest.raises(RuntimeError, match="k=6 is not supported"):
        LinearKbit(64, 32, k=6)
    with pytest.raises(ValueError, match="input has 60 features"):
        module(torch.zeros(2, 60))


def test_lazy_quantization_of_a_float_module():
    lin = make_linear(64, 32, True, "lazy")
    module = LinearKbit(64, 32, k=4)
    with torch.no_grad():
        module.weight.copy_(lin.weight)
        module.bias.copy_(lin.bias)
    assert not module.is_quantized
    module.to("cpu")  # only a CUDA move quantizes
    assert not module.is_quantized
    x = torch.randn(2, 64, generator=seeded("lazy-x"))
    y = module(x)
    assert module.is_quantized
    assert torch.equal(y, LinearKbit.from_linear(lin, k=4)(x))


def test_quantize_on_move_but_not_after_to_empty():
    """The CUDA rule (.cuda() quantizes a float weight), exercised on the CPU by adding "cpu" to the rule."""
    lin = make_linear(64, 32, True, "move")
    module = LinearKbit(64, 32, k=3)
    module.quantize_on_move_device_types = ("cpu",)
    with torch.no_grad():
        module.weight.copy_(lin.weight)
        module.bias.copy_(lin.bias)
    module.to("cpu")
    assert module.is_quantized
    assert torch.equal(module.weight, LinearKbit.from_linear(lin, k=3).weight)

    empty = LinearKbit(64, 32, k=3, device="meta")
    empty.quantize_on_move_device_types = ("cpu",)
    empty.to_empty(device="cpu")  # no values yet: must stay a float placeholder
    assert not empty.is_quantized


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_backward_grad_input(dtype):
    lin = make_linear(70, 48, True, "bw", dtype)
    module = LinearKbit.from_linear(lin, k=4)
    x = torch.randn(4, 70, generator=seeded("bw-x", dtype)).to(dtype).requires_grad_()
    g = torch.randn(4, 48, generator=seeded("bw-g", dtype)).to(dtype)
    module(x).backward(g)

    W = module.dequantize(torch.float32)
    x_ref = x.detach().float().requires_grad_()
    bias_ref = module.bias.detach().float().requires_grad_()
    (x_ref @ W.t() + bias_ref).backward(g.float())
    # grad_x = g @ W in the compute dtype: same bound as the forward with K = out_features.
    bound = torch.finfo(dtype).eps * (g.float().abs() @ W.abs()) * 2 + 1e-7
    assert bool(((x.grad.float() - x_ref.grad).abs() <= bound).all())
    torch.testing.assert_close(module.bias.grad.float(), bias_ref.grad, rtol=torch.finfo(dtype).eps * 4, atol=1e-6)
    assert module.weight.grad is None and not module.weight.requires_grad
    assert module.absmax.grad is None and module.codebook.grad is None


def test_backward_does_not_keep_a_float_weight():
    module = LinearKbit.from_linear(make_linear(64, 32, False, "saved"), k=4)
    x = torch.randn(2, 64, generator=seeded("saved-x")).requires_grad_()
    y = module(x)
    saved = [t for t in y.grad_fn.saved_tensors] if hasattr(y.grad_fn, "saved_tensors") else []
    node = y.grad_fn
    while node is not None and not saved:
        saved = list(getattr(node, "saved_tensors", []))
        node = node.next_functions[0][0] if node.next_functions else None
    assert saved and all(not t.is_floating_point() or t.numel() <= 16 for t in saved)


class TinyMLP(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.up = LinearKbit.from_linear(make_linear(64, 96, True, "mlp-up", k), k=k)
        self.down = LinearKbit.from_linear(make_linear(96, 40, False, "mlp-down", k), k=k)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("fused", [False, True], ids=["flat", "fused"])
def test_torch_compile_fullgraph_no_graph_break(fused):
    torch._dynamo.reset()
    model = TinyMLP(k=3)
    if fused:
        for m in (model.up, model.down):
            m.fused_device_types = ("cpu",)
            m.prepare_for_inference()
    x = torch.randn(3, 64, generator=seeded("compile", fused)).bfloat16()
    eager = model(x)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    # Autograd through the compiled graph: grad w.r.t. the input only.
    xg = x.clone().requires_grad_()
    compiled(xg).float().sum().backward()
    xe = x.clone().requires_grad_()
    model(xe).float().sum().backward()
    torch.testing.assert_close(xg.grad, xe.grad)
    assert model.up.weight.grad is None


def test_params_kbit_round_trip():
    W = torch.randn(16, 40, generator=seeded("params")) * 0.1
    p = ParamsKbit.quantize(W, k=4)
    assert p.padded_in_features == 64 and p.packed.numel() == 16 * 64 // 32 * 4
    assert p.dequantize().shape == (16, 40)
    with pytest.raises(RuntimeError, match="expected 2-D"):
        ParamsKbit.quantize(W.flatten(), k=4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("k", K_BITS, ids=lambda v: f"k{v}")
def test_cuda_move_quantizes_and_matches_cpu(k, dtype):
    lin = make_linear(70, 48, True, "cuda", k)
    # the absmax rule: the CUDA quantize kernel against the reference bit for bit (the "mse" default runs the
    # same PyTorch code on both devices: tests/test_scale_search.py::test_cuda_mse_matches_cpu)
    module = LinearKbit(70, 48, k=k, scale_method="absmax")
    with torch.no_grad():
        module.weight.copy_(lin.weight)
        module.bias.copy_(lin.bias)
    module.cuda()
    assert module.is_quantized and module.weight.device.type == "cuda"
    cpu = LinearKbit.from_linear(lin, k=k, scale_method="absmax")
    assert torch.equal(module.weight.cpu(), cpu.weight) and torch.equal(module.absmax.cpu(), cpu.absmax)
    x = torch.randn(9, 70, generator=seeded("cuda-x", k, dtype)).to(dtype)
    y = module(x.cuda())
    assert module._tiled == ("cuda" in module.fused_device_types)  # repacked in place once, kept
    # The fused kernel rounds codebook x scale to the compute dtype (tests/test_kbit_gemm.py derives
    # the tolerance): relative Frobenius error against the float64 reference.
    y_ref = reference(cpu, x).detach()
    rel = float((y.detach().cpu().double() - y_ref).norm() / y_ref.norm())
    assert rel <= (2e-3 if dtype == torch.float16 else 1e-2), rel
    xg = x.cuda().requires_grad_()
    module(xg).sum().backward()
    assert xg.grad is not None and module.weight.grad is None


@pytest.mark.cuda
def test_cuda_compile_fullgraph_no_graph_break():
    """A model of LinearKbit layers on CUDA (fused kbit_gemm) compiles with inductor, fullgraph."""
    torch._dynamo.reset()
    model = TinyMLP(k=4).cuda()
    for m in (model.up, model.down):
        m.prepare_for_inference()
        assert m._tiled
    x = torch.randn(5, 64, generator=seeded("cuda-compile")).to("cuda", torch.bfloat16)
    eager = model(x)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)  # the same kernel on the same data


@pytest.mark.parametrize("scale_method", ["mse", "absmax"])
def test_linear_kbit_passes_scale_method(scale_method):
    g = seeded("linear", scale_method)
    lin = torch.nn.Linear(64, 24)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 64, generator=g) * 0.02 / torch.rand(24, 64, generator=g).clamp_min(0.05))
    expected, absmax, _cb = F.quantize_kbit(lin.weight.detach(), k=3, scale_method=scale_method)
    module = LinearKbit.from_linear(lin, k=3, scale_method=scale_method)
    assert torch.equal(module.weight, expected) and torch.equal(module.absmax, absmax)
    assert torch.equal(module.codebook, F.create_codebook(F.DEFAULT_CODEBOOK[3], 3))
    lazy = LinearKbit(64, 24, k=3, scale_method=scale_method)  # quantized by quantize_(), with its own method
    with torch.no_grad():
        lazy.weight.copy_(lin.weight)
    lazy.quantize_()
    assert torch.equal(lazy.weight, expected) and torch.equal(lazy.absmax, absmax)
    with pytest.raises(RuntimeError, match="scale_method='best'"):
        LinearKbit(64, 24, scale_method="best")

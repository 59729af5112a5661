"""Bad input, checkpoints and concurrency (issue 66): each case either raises a clear error naming
the argument, the value and what is expected, or behaves correctly."""

import copy
import io
import pickle
import threading
import time
import warnings

import pytest
import torch
from conftest import run_threads, seeded
from torch import nn

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.nn import LinearKbit


def make_linear(in_features, out_features, *seed, scale=0.05):
    g = seeded("robust-linear", in_features, out_features, *seed)
    lin = nn.Linear(in_features, out_features)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=g) * scale)
        lin.bias.copy_(torch.randn(out_features, generator=g) * 0.1)
    return lin


def reference(module: LinearKbit, x: torch.Tensor) -> torch.Tensor:
    W = module.dequantize(torch.float32).double()
    return x.double() @ W.t() + module.bias.double()


# ---------------------------------------------------------------- loading is transactional


def _state(k=4, codebook="nf"):
    module = LinearKbit.from_linear(make_linear(70, 48, "sd", k), k=k, codebook=codebook)
    return module, {key: v.clone() for key, v in module.state_dict().items()}


def _snapshot(module):
    return {key: (v.dtype, tuple(v.shape), v.clone()) for key, v in module.state_dict().items()}


def _assert_unchanged(module, before):
    after = module.state_dict()
    assert set(after) == set(before)
    for key, (dtype, shape, value) in before.items():
        assert after[key].dtype == dtype and tuple(after[key].shape) == shape and torch.equal(after[key], value), key


@pytest.mark.parametrize("missing", ["absmax", "codebook", "kbit_format"])
@pytest.mark.parametrize("strict", [True, False], ids=["strict", "nonstrict"])
def test_load_with_a_missing_key_changes_nothing(missing, strict):
    _, sd = _state()
    target = LinearKbit.from_linear(make_linear(70, 48, "target"), k=3)
    before = _snapshot(target)
    x = torch.randn(2, 70, generator=seeded("missing-x", missing))
    y_before = target(x)
    del sd[missing]
    with pytest.raises(RuntimeError, match=f"lacks {missing}"):
        target.load_state_dict(sd, strict=strict)
    _assert_unchanged(target, before)
    assert torch.equal(target(x), y_before)


def test_load_rejects_bad_tensors_before_changing_anything():
    source, sd = _state(k=3, codebook="uniform")  # 7 levels: a shorter codebook is legal, out-of-range indices not
    cases = {
        "truncated weight": (dict(sd, weight=sd["weight"][:-3]), r"weight is torch.int32 \(\d+,\); expected int32"),
        "k=7": (dict(sd, kbit_format=torch.tensor([1, 7, 48, 70, 96], dtype=torch.int32)), r"k=7 is not supported"),
        "absmax length": (dict(sd, absmax=sd["absmax"][:-1]), r"absmax is torch.uint8"),
        "codebook dtype": (dict(sd, codebook=sd["codebook"].double()), r"codebook is torch.float64"),
        "codebook too long": (dict(sd, codebook=torch.linspace(-1, 1, 9)), r"expected float32 with 1..8 entries"),
        "codebook too short": (dict(sd, codebook=sd["codebook"][:3].contiguous()), r"uses index [3-6]"),
        "padded": (dict(sd, kbit_format=torch.tensor([1, 3, 48, 70, 64], dtype=torch.int32)), "padded_in_features=64"),
        "version 0": (dict(sd, kbit_format=torch.tensor([0, 3, 48, 70, 96], dtype=torch.int32)), "format version 0"),
        "unsorted codebook": (dict(sd, codebook=sd["codebook"].flip(0).contiguous()), "not in ascending order"),
    }
    for bad, message in cases.values():
        for target in (LinearKbit(70, 48, k=4), LinearKbit.from_linear(make_linear(70, 48, "t2"), k=5)):
            before = _snapshot(target)
            with pytest.raises(RuntimeError, match=message):
                target.load_state_dict(bad)
            _assert_unchanged(target, before)
    # shapes that torch's own loading refuses only after copying the other tensors
    for bad, message in (
        (dict(sd, bias=torch.zeros(47)), r"bias has shape \(47,\); expected \(48,\)"),
        ({"weight": torch.randn(47, 70), "bias": torch.zeros(48)}, r"weight is a float tensor of shape \(47, 70\)"),
    ):
        target = LinearKbit.from_linear(make_linear(70, 48, "t4"), k=5)
        before = _snapshot(target)
        with pytest.raises(RuntimeError, match=message):
            target.load_state_dict(bad)
        _assert_unchanged(target, before)
    # the untouched state still loads, and a codebook exactly as long as the indices need is accepted
    target = LinearKbit(70, 48, k=4)
    target.load_state_dict(sd)
    x = torch.randn(2, 70, generator=seeded("bad-x"))
    assert torch.equal(target(x), source(x))


# ---------------------------------------------------------------- thread safety of the lazy quantize / repack


def _slowed(fn, calls):
    """fn, sleeping first (the GIL is released): widens the window in which threads race. Counts calls."""

    def slow(*args, **kwargs):
        calls.append(fn.__name__)
        time.sleep(0.02)
        return fn(*args, **kwargs)

    return slow


class _SlowLayoutFlag(LinearKbit):
    """Reading the layout flag yields the GIL: the check-then-convert window of a racy lazy repack."""

    @property
    def _tiled(self):
        time.sleep(0.01)
        return self.__dict__["_tiled_flag"]

    @_tiled.setter
    def _tiled(self, value):
        self.__dict__["_tiled_flag"] = value


@pytest.mark.parametrize("fused", [False, True], ids=["flat", "tiled"])
def test_concurrent_first_forward(fused, monkeypatch):
    calls = []
    monkeypatch.setattr(F, "repack_kbit", _slowed(F.repack_kbit, calls))
    monkeypatch.setattr(F, "quantize_kbit", _slowed(F.quantize_kbit, calls))
    lin = make_linear(512, 384, "threads", fused)
    x = torch.randn(4, 512, generator=seeded("threads-x", fused), dtype=torch.float32).to(torch.bfloat16)
    expected = LinearKbit.from_linear(lin, k=4)
    expected.fused_device_types = ("cpu",) if fused else ()
    y_ref = expected(x)
    rng = seeded("threads-delays", fused)
    for trial in range(8):
        delays = (torch.rand(4, generator=rng) * 0.04).tolist()
        calls.clear()
        module = _SlowLayoutFlag(512, 384, k=4)
        module.fused_device_types = ("cpu",) if fused else ()
        with torch.no_grad():
            module.weight.copy_(lin.weight)
            module.bias.copy_(lin.bias)
        barrier = threading.Barrier(4)
        outputs = [None] * 4

        def run(i, module=module, barrier=barrier, delays=delays, outputs=outputs):
            barrier.wait()
            time.sleep(delays[i])
            outputs[i] = module(x)

        run_threads(run, 4)
        assert module._tiled == fused
        # quantized once, and repacked once on the fused path
        assert sorted(calls) == (["quantize_kbit", "repack_kbit"] if fused else ["quantize_kbit"]), calls
        for y in outputs + [module(x)]:
            assert torch.equal(y, y_ref), f"trial {trial}"


def test_module_with_lock_pickles_and_deepcopies():
    module = LinearKbit.from_linear(make_linear(64, 32, "pickle"), k=4)
    module.fused_device_types = ("cpu",)
    x = torch.randn(3, 64, generator=seeded("pickle-x")).bfloat16()
    y = module(x)
    for clone in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert torch.equal(clone(x), y)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), y)


# ---------------------------------------------------------------- LinearKbit input checks


def test_linear_kbit_rejects_bad_inputs():
    module = LinearKbit.from_linear(make_linear(64, 32, "inputs"), k=4)
    with pytest.raises(TypeError, match=r"input has dtype torch.int64; expected a floating-point"):
        module(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="0-d tensor"):
        module(torch.tensor(1.0))
    with pytest.raises(ValueError, match="input has 63 features; expected in_features=64"):
        module(torch.ones(2, 63))
    for name, args in (("in_features", (0, 8)), ("out_features", (8, 0)), ("in_features", (8.0, 8))):
        with pytest.raises(ValueError, match=f"{name}=.*expected an integer >= 1"):
            LinearKbit(*args)


def test_from_linear_above_the_e4m4_range_names_what_to_do():
    lin = make_linear(64, 32, "big")
    with torch.no_grad():
        lin.weight[3, 5] = 40.0
    with pytest.raises(ValueError, match=r"max \|w\| = 40.*E4M4.*scale the weight down") as info:
        LinearKbit.from_linear(lin, k=4)
    assert "absmax_format" not in str(info.value)  # LinearKbit has no such option


def test_float_cast_of_the_packed_weight_is_explained():
    module = LinearKbit.from_linear(make_linear(64, 32, "qlora"), k=4)
    for p in module.parameters():  # the common QLoRA recipe
        if p.ndim == 1:
            p.data = p.data.to(torch.float32)
    with pytest.raises(RuntimeError, match=r"weight is a torch.float32 tensor of shape \(256,\).*cast to float"):
        module(torch.randn(2, 64))


# ---------------------------------------------------------------- functional API: arguments and data


def test_unclear_argument_errors_name_the_argument():
    A = torch.randn(64, generator=seeded("args"))
    packed, absmax, cb = F.quantize_kbit(A, k=4)
    for bad in (4.0, "4", True):
        with pytest.raises(TypeError, match=rf"k={bad!r} is a {type(bad).__name__}; expected an int"):
            F.quantize_kbit(A, k=bad)
        with pytest.raises(TypeError, match="expected an int"):
            F.dequantize_kbit(packed, absmax, cb, k=bad, n=64)
    with pytest.raises(TypeError, match=r"n=64.0 is a float; expected an int"):
        F.dequantize_kbit(packed, absmax, cb, k=4, n=64.0)
    with pytest.raises(ValueError, match=r"n=9223372036854775808 is out of range"):
        F.dequantize_kbit(packed, absmax, cb, k=4, n=2**63)
    with pytest.raises(ValueError, match=r"absmax_format=\['e4m4'\] is not supported"):
        F.quantize_kbit(A, absmax_format=["e4m4"])
    with pytest.raises(ValueError, match="A is on the meta device"):
        F.quantize_kbit(torch.empty(64, device="meta"))
    W = torch.randn(32, 64, generator=seeded("args-W")) * 0.1
    p2, a2, _ = F.quantize_kbit(W, k=4)
    Bp, Ba = F.repack_kbit(p2, a2, 4, 32, 64)
    x = torch.randn(2, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="kbit_gemm: codebook is NoneType; expected the float32 tensor"):
        F.kbit_gemm(x, Bp, Ba, None, 4, 32, 64)
    with pytest.raises(TypeError, match=r"repack_kbit: N=32.0 is a float"):
        F.repack_kbit(p2, a2, 4, 32.0, 64)
    for bad in (4.0, "4", True):
        with pytest.raises(TypeError, match=rf"kbit_gemm: k={bad!r} is a {type(bad).__name__}; expected an int"):
            F.kbit_gemm(x, Bp, Ba, cb, bad, 32, 64)
    with pytest.raises(TypeError, match=r"kbit_gemm: N=32.0 is a float; expected an int"):
        F.kbit_gemm(x, Bp, Ba, cb, 4, 32.0, 64)
    with pytest.raises(TypeError, match=r"kbit_gemm: K=64.0 is a float; expected an int"):
        F.kbit_gemm(x, Bp, Ba, cb, 4, 32, 64.0)
    with pytest.raises(ValueError, match=r"kbit_gemm: N=9223372036854775808 is out of range"):
        F.kbit_gemm(x, Bp, Ba, cb, 4, 2**63, 64)
    with pytest.raises(TypeError, match=r"unrepack_kbit: N=32.0 is a float; expected an int"):
        F.unrepack_kbit(Bp, Ba, 4, 32.0, 64)
    with pytest.raises(TypeError, match=r"unrepack_kbit: k='4' is a str"):
        F.unrepack_kbit(Bp, Ba, "4", 32, 64)
    import numpy as np

    assert torch.equal(
        F.dequantize_kbit(packed, absmax, cb, k=np.int64(4), n=np.int64(64)),
        F.dequantize_kbit(packed, absmax, cb, 4, 64),
    )


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_dequantize_with_the_unsorted_user_codebook(k):
    g = seeded("unsorted", k)
    user = torch.randn(2**k, generator=g)  # any order
    A = torch.randn(200, generator=g)
    packed, absmax, cb = F.quantize_kbit(A, k=k, codebook=user)
    from_sorted = F.dequantize_kbit(packed, absmax, cb, k, 200, dtype=torch.float32)
    from_user = F.dequantize_kbit(packed, absmax, user, k, 200, dtype=torch.float32)
    assert torch.equal(from_user, from_sorted)
    # independent reference: nearest sorted level times the block's scale
    scale = F.decode_absmax_e4m4(absmax).repeat_interleave(32)[:200]
    assert torch.equal(from_sorted, cb[(A[:, None] / scale[:, None] - cb).abs().argmin(1)] * scale)


def _too_short_codebook_case(device):
    A = torch.linspace(-1, 1, 96, device=device)
    packed, absmax, cb = F.quantize_kbit(A, k=3, codebook="uniform")  # 7 levels, indices 0..6
    return packed, absmax, cb[:4].contiguous()


def test_codebook_shorter_than_the_indices_is_an_error():
    packed, absmax, short = _too_short_codebook_case("cpu")
    with pytest.raises(ValueError, match=r"codebook has 4 entries but packed holds index 6"):
        F.dequantize_kbit(packed, absmax, short, 3, 96)
    with pytest.raises(ValueError, match=r"codebook has 4 entries"):
        F.dequantize_kbit(packed, absmax, short, 3, 96, out=torch.empty(96, dtype=torch.float16))


@pytest.mark.cuda
def test_codebook_shorter_than_the_indices_is_an_error_cuda():
    packed, absmax, short = _too_short_codebook_case("cuda")
    with pytest.raises(ValueError, match=r"codebook has 4 entries but packed holds index 6"):
        F.dequantize_kbit(packed, absmax, short, 3, 96)
    # under CUDA-graph capture the host cannot read the indices: capture works and the missing levels read NaN
    expected = F.dequantize_kbit(packed.cpu(), absmax.cpu(), F.nan_padded_codebook(short.cpu(), 3), 3, 96)
    assert 0 < int(torch.isnan(expected).sum()) < 96
    out = torch.empty(96, dtype=torch.float16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        F.dequantize_kbit(packed, absmax, short, 3, 96, out=out)
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gemm_with_a_codebook_shorter_than_the_indices_gives_nan(device):
    """kbit_gemm cannot check the indices every call: the levels a short codebook lacks read NaN, so a weight it
    does not cover gives NaN rows instead of a silently wrong product; a codebook that covers them is exact."""
    W = torch.linspace(-1, 1, 32 * 64).view(32, 64)  # rows 0..15 negative, 16..31 positive
    packed, absmax, cb = F.quantize_kbit(W, k=3, codebook="uniform", scale_method="absmax")  # 7 levels, 0..6
    Bp, Ba = (t.to(device) for t in F.repack_kbit(packed, absmax, 3, 32, 64))
    cb = cb.to(device)
    x = torch.randn(2, 64, generator=seeded("short-gemm")).half().to(device)
    full = F.kbit_gemm(x, Bp, Ba, cb, 3, 32, 64)
    assert torch.isfinite(full).all()
    # which rows use the top level (flat layout: a row of 64 is 2 blocks of k = 3 words)
    uses_top = [r for r in range(32) if F.max_stored_index(packed[r * 6 : (r + 1) * 6], 3) == 6]
    rest = [r for r in range(32) if r not in uses_top]
    assert uses_top and rest
    y = F.kbit_gemm(x, Bp, Ba, cb[:6].contiguous(), 3, 32, 64)  # lacks the top level
    assert torch.isnan(y[:, uses_top]).all()
    assert torch.equal(y[:, rest], full[:, rest])


@pytest.mark.parametrize("scale_method", ["absmax", "mse"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 40.0], ids=["nan", "inf", "above-e4m4"])
def test_compiled_quantize_refuses_what_eager_refuses(bad, scale_method):
    """Compiled, quantize_kbit cannot read max |A| on the host: an assert in the graph raises at run time (on CUDA a
    device-side assert) for the inputs the eager call refuses with a ValueError."""
    A = torch.randn(4, 64, generator=seeded("compile-bad"))
    compiled = torch.compile(lambda a: F.quantize_kbit(a, k=3, scale_method=scale_method), fullgraph=True)
    for got, want in zip(compiled(A), F.quantize_kbit(A, k=3, scale_method=scale_method)):
        assert torch.equal(got, want)
    A[1, 5] = bad
    with pytest.raises(ValueError):
        F.quantize_kbit(A, k=3, scale_method=scale_method)
    with pytest.raises(RuntimeError, match="quantize_kbit: A contains NaN or Inf, or max"):
        compiled(A)


def test_quantize_compiles_fullgraph():
    A = torch.randn(4, 64, generator=seeded("compile-q"))
    compiled = torch.compile(lambda a: F.quantize_kbit(a, k=3), fullgraph=True, backend="eager")
    for got, want in zip(compiled(A), F.quantize_kbit(A, k=3)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kind,k", [("nf", 2), ("nf", 3), ("nf", 4), ("nf", 5), ("uniform", 2), ("uniform", 4), ("fp4", 4)]
)
def test_error_bound_across_the_e4m4_range(kind, k):
    """docs/format.md: the relative bound for amax >= 2^-10, the absolute one below (E4M4 subnormals), for the
    absmax scale rule (the error-minimizing rule trades a larger error on the block's largest element for a smaller
    block error; tests/test_scale_search.py holds it to at most the absmax rule's block error)."""
    g = seeded("bound", kind, k)
    amax = torch.exp(torch.empty(4000).uniform_(-17.0, 3.4, generator=g))  # 4e-8 .. 30
    x = (torch.rand(4000, 32, generator=g) * 2 - 1) * amax[:, None]
    x[torch.arange(4000), torch.randint(0, 32, (4000,), generator=g)] = amax  # the block's max is amax
    packed, absmax, cb = F.quantize_kbit(x, k=k, codebook=kind, scale_method="absmax")
    value = F.dequantize_kbit(packed, absmax, cb, k, x.numel(), torch.float32).view_as(x).double()
    err = (x.double() - value).abs()
    gap = float((cb[1:] - cb[:-1]).max())
    a = amax.double()[:, None]
    normal = a >= 2**-10
    relative = (gap / 2 + 1 / 16) * a + 1e-6
    absolute = (gap / 2) * (a + 2**-14) + 2**-15
    assert bool((err <= relative)[normal.expand_as(err)].all())
    assert bool((err <= absolute)[(~normal).expand_as(err)].all())


def test_tensor_below_the_e4m4_normal_range_warns():
    A = torch.randn(256, generator=seeded("tiny")) * 1e-5
    with pytest.warns(UserWarning, match=r"below the E4M4 normal range.*absmax_format='fp16'"):
        F.quantize_kbit(A, k=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.quantize_kbit(A, k=4, absmax_format="fp32")
        F.quantize_kbit(A * 1e3, k=4)


def test_weight_numel_is_the_logical_count():
    module = LinearKbit.from_linear(make_linear(70, 48, "numel"), k=3)
    assert module.weight_numel == 70 * 48 and module.weight.numel() == 48 * 96 // 32 * 3


def test_num_parameters_counts_logical_weights():
    """nn.num_parameters: a quantized LinearKbit weight counts out x in (the float layer's count), everything else
    its elements; tied parameters once; only_trainable and exclude_embeddings as transformers defines them."""
    from bitsandbytes_kbit.nn import num_parameters

    emb = nn.Embedding(40, 70)
    lin_a, lin_b = make_linear(70, 48, "count-a"), make_linear(48, 40, "count-b")
    float_model = nn.Sequential(emb, lin_a, nn.LayerNorm(48), lin_b)
    expected = sum(p.numel() for p in float_model.parameters())
    kbit = nn.Sequential(emb, LinearKbit.from_linear(lin_a, k=3), nn.LayerNorm(48), LinearKbit.from_linear(lin_b, k=5))
    assert sum(p.numel() for p in kbit.parameters()) < expected  # packed words
    assert num_parameters(kbit) == expected
    assert num_parameters(kbit, exclude_embeddings=True) == expected - 40 * 70
    trainable = sum(p.numel() for p in kbit.parameters() if p.requires_grad)
    assert not kbit[1].weight.requires_grad and num_parameters(kbit, only_trainable=True) == trainable
    kbit.append(kbit[1])  # the same layer twice: counted once
    assert num_parameters(kbit) == expected
    lazy = LinearKbit(70, 48, k=3)  # not quantized yet: a float weight of out x in elements
    assert not lazy.is_quantized and num_parameters(lazy) == 70 * 48 + 48


@pytest.mark.cuda
def test_concurrent_first_forward_cuda():
    lin = make_linear(512, 384, "threads-cuda")
    x = torch.randn(4, 512, generator=seeded("threads-cuda-x")).to(device="cuda", dtype=torch.bfloat16)
    y_ref = LinearKbit.from_linear(lin, k=4).cuda()(x)
    for _ in range(5):
        module = LinearKbit(512, 384, k=4, device="cuda")  # float weight on CUDA: quantized at the first forward
        module.quantize_on_move_device_types = ()
        with torch.no_grad():
            module.weight.copy_(lin.weight)
            module.bias.copy_(lin.bias)
        barrier = threading.Barrier(4)
        outputs = [None] * 4

        def run(i, module=module, barrier=barrier, outputs=outputs):
            barrier.wait()
            outputs[i] = module(x)
            torch.cuda.synchronize()

        run_threads(run, 4)
        assert module._tiled
        for y in outputs + [module(x)]:
            assert torch.equal(y, y_ref)

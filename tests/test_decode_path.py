"""The inference host path: an eager ``kbit_gemm`` / ``LinearKbit`` call on plain tensors goes straight to the
device launcher (no dispatcher, no autograd node); anything the launcher cannot serve (autograd, tensor subclasses,
dispatch modes, torch.compile) takes the op. Both must give the same result, and a decoder's output through the fast
path, a CUDA graph of it and the op must agree.

Reference: the op (``torch.ops.bitsandbytes.kbit_gemm``), which the other test files check against the float64
product of the dequantized weight. The fast path runs the same kernel on the same data, so results are compared
bit for bit; the decoder test compares against a bf16 model holding the dequantized weights, within the bound
stated there.
"""

import pytest
import torch
from conftest import seeded, tiny_llama
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit.nn import LinearKbit


def _linear(k, N=48, K=96, bias=True, *seed):
    g = seeded("decode-path", k, N, K, bias, *seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(N, generator=g) * 0.1)
    return lin


class _CountingLauncher:
    """A stand-in for a device launcher on CPU: counts calls and computes with the default backend into out."""

    def __init__(self):
        self.calls = 0

    def __call__(self, A, B_packed, B_absmax, codebook, k, N, K, bias, out):
        self.calls += 1
        out.copy_(torch.ops.bitsandbytes.kbit_gemm.default(A, B_packed, B_absmax, codebook, k, N, K, bias))


class _CountingMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def cpu_launcher(monkeypatch):
    launcher = _CountingLauncher()
    monkeypatch.setitem(F._eager_gemm, "cpu", launcher)
    return launcher


@pytest.mark.parametrize("k", [2, 5], ids=lambda v: f"k{v}")
def test_eager_no_grad_call_takes_the_launcher_and_matches_the_op(k, cpu_launcher):
    module = LinearKbit.from_linear(_linear(k), k=k)
    module.fused_device_types = ("cpu",)
    module.prepare_for_inference()
    x = torch.randn(3, 96, generator=seeded("x", k)).bfloat16()
    with torch.no_grad():
        y = module(x)
    assert cpu_launcher.calls == 1
    bias = module.bias.to(torch.bfloat16)
    expected = torch.ops.bitsandbytes.kbit_gemm(x, module.weight, module.absmax, module.codebook, k, 48, 96, bias)
    assert torch.equal(y, expected)
    # functional.kbit_gemm: the same launcher after the op's checks, also into a given out
    out = torch.full((3, 48), float("nan"), dtype=torch.bfloat16)
    with torch.no_grad():
        F.kbit_gemm(x, module.weight, module.absmax, module.codebook, k, 48, 96, bias=bias, out=out)
    assert cpu_launcher.calls == 2 and torch.equal(out, expected)


def test_autograd_and_dispatch_modes_take_the_op(cpu_launcher):
    module = LinearKbit.from_linear(_linear(4), k=4)
    module.fused_device_types = ("cpu",)
    module.prepare_for_inference()
    x = torch.randn(2, 96, generator=seeded("x-grad")).bfloat16()
    # an input that needs a gradient: the autograd function (its forward may use the launcher), the same output,
    # and the input's gradient is grad_y @ W
    with torch.no_grad():
        y_ref = module(x)
    xg = x.clone().requires_grad_()
    y = module(xg)
    assert y.grad_fn is not None and torch.equal(y.detach(), y_ref)
    y.float().sum().backward()
    W = module.dequantize(torch.float32)
    torch.testing.assert_close(xg.grad.float(), torch.ones(2, 48) @ W, rtol=2e-2, atol=2e-2)
    cpu_launcher.calls = 0
    # a dispatch mode sees the op
    mode = _CountingMode()
    with torch.no_grad(), mode:
        module(x)
    assert cpu_launcher.calls == 0 and any("kbit_gemm" in op for op in mode.ops)
    # a bias that needs a gradient
    module.bias.requires_grad_(True)
    module.bias.grad = None
    y = module(x)
    assert y.grad_fn is not None
    y.float().sum().backward()
    assert torch.equal(module.bias.grad, torch.full((48,), 2.0))


def test_fast_path_checks_arguments_as_the_op_does(cpu_launcher):
    module = LinearKbit.from_linear(_linear(3), k=3)
    module.fused_device_types = ("cpu",)
    module.prepare_for_inference()
    W, absmax, cb = module.weight, module.absmax, module.codebook
    x = torch.randn(2, 96).half()
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"A has 64 features"):
            F.kbit_gemm(x[:, :64], W, absmax, cb, 3, 48, 96)
        with pytest.raises(RuntimeError, match="B_packed has shape"):
            F.kbit_gemm(x, W[:-1], absmax, cb, 3, 48, 96)
        with pytest.raises(RuntimeError, match=r"out has shape \(2, 47\)"):
            F.kbit_gemm(x, W, absmax, cb, 3, 48, 96, out=torch.empty(2, 47, dtype=torch.float16))
        with pytest.raises(RuntimeError, match="out has dtype torch.bfloat16"):
            F.kbit_gemm(x, W, absmax, cb, 3, 48, 96, out=torch.empty(2, 48, dtype=torch.bfloat16))
    assert cpu_launcher.calls == 0


# ---------------------------------------------------------------- CUDA


def _cuda_module(k, N, K, bias, dtype):
    return LinearKbit.from_linear(_linear(k, N, K, bias, "cuda").to(dtype), k=k).cuda().prepare_for_inference()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("k", [2, 3, 4, 5], ids=lambda v: f"k{v}")
@pytest.mark.parametrize("M", [1, 7, 16, 40, 300], ids=lambda v: f"M{v}")
def test_cuda_fast_path_equals_the_op(M, k, dtype):
    N, K = 272, 512
    module = _cuda_module(k, N, K, True, dtype)
    g = seeded("cuda-fast", M, k, dtype)
    x = torch.randn(M, K, generator=g).to("cuda", dtype)
    bias = module.bias
    expected = torch.ops.bitsandbytes.kbit_gemm(x, module.weight, module.absmax, module.codebook, k, N, K, bias)
    with torch.no_grad():
        assert torch.equal(module(x), expected)
        out = torch.full((M, N), float("nan"), dtype=dtype, device="cuda")
        F.kbit_gemm(x, module.weight, module.absmax, module.codebook, k, N, K, bias=bias, out=out)
        assert torch.equal(out, expected)
        # a strided input (every other row of a larger buffer) and a 3-D one
        wide = torch.randn(2 * M, K, generator=g).to("cuda", dtype)
        strided = wide[::2]
        ref = torch.ops.bitsandbytes.kbit_gemm(
            strided.contiguous(), module.weight, module.absmax, module.codebook, k, N, K, bias
        )
        assert torch.equal(module(strided), ref)
        assert torch.equal(module(x.view(1, M, K)), expected.view(1, M, N))


@pytest.mark.cuda
def test_cuda_fast_path_under_graph_capture():
    """The eager fast path records into a CUDA graph like the op's .out overload: replays follow new inputs."""
    module = _cuda_module(4, 128, 256, False, torch.float16)
    x = torch.randn(1, 256, generator=seeded("graph")).to("cuda", torch.float16)
    with torch.no_grad():
        module(x)  # the workspace exists before capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = module(x)
        for seed in range(3):
            x.copy_(torch.randn(1, 256, generator=seeded("graph", seed)).to("cuda", torch.float16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, module(x))


@pytest.mark.cuda
@pytest.mark.parametrize("M", [1, 96], ids=["fused", "staged"])
def test_cuda_reduce_overhead_compile_keeps_no_buffer_in_the_graph_pool(M, monkeypatch):
    """torch.compile(mode="reduce-overhead") (inductor's cudagraph trees; transformers' static-cache generate() uses
    it): the first k-bit call on the tree's stream happens while the tree warms up, so the buffers the backend keeps
    (split-K workspace, staging scratch) are made then. They must live outside the graph's private pool, which must
    hold only the graph's outputs (checked on every step here). Replays follow new inputs and equal eager calls."""
    from bitsandbytes_kbit.backends.cuda import ops as cuda_ops

    for name in ("_workspaces", "_graph_workspaces", "_scratch"):
        monkeypatch.setattr(cuda_ops, name, {})
    monkeypatch.setattr(cuda_ops, "_captured_workspaces", [])
    monkeypatch.setattr(cuda_ops, "_captured_ids", set())
    monkeypatch.setattr(cuda_ops, "_staged_preferred", lambda *args: M >= cuda_ops.STAGED_MIN_M)
    monkeypatch.setattr(torch._inductor.config.triton, "slow_path_cudagraph_asserts", True)
    module = _cuda_module(4, 1024, 2048, True, torch.float16)
    torch._dynamo.reset()
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for seed in range(4):  # warm-up, recording, replays
            x = torch.randn(M, 2048, generator=seeded("reduce-overhead", M, seed)).to("cuda", torch.float16)
            y = compiled(x).clone()
            expected = module(x)
            if M < cuda_ops.STAGED_MIN_M:
                assert torch.equal(y, expected)
            else:  # cuBLAS may pick another algorithm inside a graph
                torch.testing.assert_close(y, expected, rtol=2e-3, atol=2e-3)
    torch._dynamo.reset()


def _decoder_pair(k):
    """A tiny Llama (hidden 64) on CUDA in bf16 with its linear layers in k bits, and the same model in bf16 with the
    k-bit weights dequantized into plain nn.Linear layers (so only the kernel's arithmetic differs)."""
    kbit = tiny_llama(seed=k).to("cuda", torch.bfloat16)
    ref = tiny_llama(seed=k).to("cuda", torch.bfloat16)
    for layer_q, layer_r in zip(kbit.model.layers, ref.model.layers):
        for part in ("self_attn", "mlp"):
            parent_q, parent_r = getattr(layer_q, part), getattr(layer_r, part)
            for name, lin in list(parent_q.named_children()):
                if isinstance(lin, nn.Linear):
                    q = LinearKbit.from_linear(lin, k=k).prepare_for_inference()
                    setattr(parent_q, name, q)
                    with torch.no_grad():
                        getattr(parent_r, name).weight.copy_(q.dequantize(torch.bfloat16))
    return kbit.eval(), ref.eval()


@pytest.mark.cuda
@pytest.mark.parametrize("k", [2, 4], ids=lambda v: f"k{v}")
def test_cuda_decoder_matches_bf16_and_replays_as_a_graph(k):
    """Logits of the k-bit decoder against the bf16 model with the dequantized weights: the kernel accumulates in
    float32 and rounds once to bf16, where cuBLAS rounds differently, so the logits agree to a few bf16 ulps of their
    scale (bound: 4 * 2^-8 * max |logit|, with two bf16 roundings per layer of the 2-layer model). Greedy decoding
    through the eager fast path and through a CUDA graph of the same step gives the same tokens and logits."""
    kbit, ref = _decoder_pair(k)
    ids = torch.randint(0, 128, (2, 12), generator=seeded("ids", k)).cuda()
    with torch.no_grad():
        lq, lr = kbit(ids).logits.float(), ref(ids).logits.float()
        assert (lq - lr).abs().max() <= 4 * 2**-8 * lr.abs().max(), float((lq - lr).abs().max())

        # one decode step, eager and as a CUDA graph, on a static cache
        from transformers import StaticCache

        def step_fn(cache):
            def step(tok, pos):
                return kbit(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits

            return step

        def prefill(cache):
            return kbit(ids, past_key_values=cache, cache_position=torch.arange(12, device="cuda"), use_cache=True)

        eager_cache = StaticCache(config=kbit.config, max_cache_len=32)
        graph_cache = StaticCache(config=kbit.config, max_cache_len=32)
        first = prefill(eager_cache).logits[:, -1].argmax(-1, keepdim=True)
        prefill(graph_cache)
        tok = first.clone()
        pos = torch.tensor([12], device="cuda")
        step = step_fn(graph_cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(tok, pos)  # warm-up on a side stream, as torch.cuda.graphs asks (rewritten below)
        torch.cuda.current_stream().wait_stream(side)
        graph_cache.reset()
        prefill(graph_cache)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_logits = step(tok, pos)
        graph_cache.reset()
        prefill(graph_cache)
        eager_tok = first.clone()
        for i in range(6):
            p = torch.tensor([12 + i], device="cuda")
            eager_logits = step_fn(eager_cache)(eager_tok, p)
            tok.copy_(eager_tok)
            pos.copy_(p)
            graph.replay()
            assert torch.equal(graph_logits, eager_logits), i
            eager_tok = eager_logits[:, -1].argmax(-1, keepdim=True)

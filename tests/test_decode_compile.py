"""The compiled decode step (docs/usage.md, "Fastest decode with CUDA graphs"; benchmarking/bench_decode.py mode c):
one greedy step of a transformers LlamaForCausalLM whose linear layers are LinearKbit, on a StaticCache with in-place
updated input buffers, traced by torch.compile(fullgraph=True) in one graph (the k-bit op stays an opaque custom op)
and matching the eager step. On the CPU the project's CPU kernels run inside the compiled graph; on CUDA the compiled
step is also captured in a CUDA graph and replayed.

Reference: the same model's eager step on its own cache, fed the same tokens (teacher forcing, so a near-tie in the
greedy choice cannot make the two runs part). Inductor computes the bf16 elementwise ops (RMSNorm, RoPE, SiLU * up)
in float32 and rounds once where eager rounds after every op, so logits agree to a few bf16 ulps of their scale:
bound 4 * 2^-8 * max |logit| (the bound of the fused-kernel decoder test in test_decode_path.py).
"""

import pytest
import torch
from conftest import seeded, tiny_llama
from torch import nn

from bitsandbytes_kbit.nn import LinearKbit

P, STEPS, MAX_LEN = 6, 5, 16


def _kbit_llama(k, fused, device="cpu", seed=0):
    """tiny_llama in bf16 with every linear layer but lm_head in k bits (down_proj has 176 inputs: a padded K)."""
    model = tiny_llama(seed=seed).to(device, torch.bfloat16)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name != "lm_head":
            q = LinearKbit.from_linear(module, k=k)
            if fused:
                q.fused_device_types = ("cpu", "cuda")  # the fused kbit_gemm op on the repacked weight
            model.set_submodule(name, q.prepare_for_inference())
    return model.eval()


def _cache_kwarg(model):
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _Decoder:
    """A StaticCache, the step's static buffers (token, position, 4D bool mask), eager prefill and one greedy step
    that updates everything in place: the shape of the recipe in docs/usage.md."""

    def __init__(self, model, prompt):
        from transformers import StaticCache

        self.model, self.prompt = model, prompt
        self.B, self.device = prompt.shape[0], prompt.device
        self.cache = StaticCache(config=model.config, max_cache_len=MAX_LEN)
        self.ck = _cache_kwarg(model)
        self.tok = torch.zeros(self.B, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(self.B, 1, 1, MAX_LEN, dtype=torch.bool, device=self.device)
        self.logits = None

    def prefill(self):
        self.cache.reset()
        causal = torch.ones(P, MAX_LEN, dtype=torch.bool, device=self.device).tril()[None, None]
        out = self.model(
            self.prompt,
            **{self.ck: self.cache},
            cache_position=torch.arange(P, device=self.device),
            attention_mask=causal.expand(self.B, 1, P, MAX_LEN),
            logits_to_keep=1,
        )
        self.tok.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        self.pos.fill_(P)
        self.mask.zero_()
        self.mask[..., :P] = True

    def step(self):
        self.mask.index_fill_(-1, self.pos, True)
        logits = self.model(
            self.tok,
            **{self.ck: self.cache},
            cache_position=self.pos,
            position_ids=self.pos.expand(self.B, 1),
            attention_mask=self.mask,
            logits_to_keep=1,
        ).logits
        self.tok.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)
        return logits


def _assert_close_logits(got, ref, what):
    got, ref = got.float(), ref.float()
    err, bound = (got - ref).abs().max().item(), 4 * 2**-8 * ref.abs().max().item()
    assert err <= bound, f"{what}: max |logit difference| {err:.3g} > bound {bound:.3g}"


def _prompt(k, B, device="cpu"):
    return torch.randint(1, 128, (B, P), generator=seeded("decode-compile", k, B)).to(device)


@pytest.mark.parametrize(
    ("k", "fused", "B"),
    [(2, False, 1), (4, True, 2)],
    ids=["k2-cpu-kernels-B1", "k4-fused-op-B2"],
)
def test_compiled_decode_step_is_one_graph_and_matches_eager(k, fused, B):
    model = _kbit_llama(k, fused, seed=k)
    prompt = _prompt(k, B)
    op = "kbit_gemm" if fused else "cpu_linear"
    with torch.no_grad():
        # Dynamo's view: one graph, no break, the k-bit layers as the opaque custom op (not its Python internals)
        probe = _Decoder(model, prompt)
        probe.prefill()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(probe.step)()
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        targets = [str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"]
        n_linear = sum(type(m) is LinearKbit for m in model.modules())
        assert sum(op in t for t in targets) == n_linear, targets

        # inductor, fullgraph: the compiled step against the eager step, fed the same tokens
        torch._dynamo.reset()
        eager, comp = _Decoder(model, prompt), _Decoder(model, prompt)
        eager.prefill()
        comp.prefill()
        compiled_step = torch.compile(comp.step, fullgraph=True, dynamic=False)
        for i in range(STEPS):
            comp.tok.copy_(eager.tok)
            ref = eager.step()
            got = compiled_step()
            _assert_close_logits(got, ref, f"step {i}")
            assert torch.equal(comp.pos, eager.pos) and torch.equal(comp.mask, eager.mask)
        # the compiled step wrote the same K/V into its cache as the eager one (up to the same rounding)
        for layer_c, layer_e in zip(comp.cache.layers, eager.cache.layers):
            assert torch.equal(layer_c.cumulative_length, layer_e.cumulative_length)
            _assert_close_logits(layer_c.keys, layer_e.keys, "cached keys")


@pytest.mark.cuda
@pytest.mark.parametrize(("k", "B"), [(2, 1), (4, 3)], ids=["k2-B1", "k4-B3"])  # each case compiles (~10 s)
def test_cuda_compiled_decode_step_captured_in_a_cuda_graph(k, B):
    """The recipe of docs/usage.md: compile, warm up on a side stream, capture, reset the cache and prefill, replay.
    Replays match the eager step fed the same tokens; torch counts no graph break."""
    from torch._dynamo.utils import counters

    model = _kbit_llama(k, fused=False, device="cuda", seed=k)
    prompt = _prompt(k, B, "cuda")
    with torch.no_grad():
        torch._dynamo.reset()
        breaks = sum(counters["graph_break"].values())
        eager, comp = _Decoder(model, prompt), _Decoder(model, prompt)
        comp.prefill()
        compiled_step = torch.compile(comp.step, fullgraph=True, dynamic=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                compiled_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_logits = compiled_step()
        comp.prefill()  # the warm-up advanced the cache: reset it in place and prefill again
        eager.prefill()
        assert torch.equal(comp.tok, eager.tok)
        for i in range(STEPS):
            comp.tok.copy_(eager.tok)
            ref = eager.step()
            graph.replay()
            _assert_close_logits(graph_logits, ref, f"replay {i}")
            assert torch.equal(comp.pos, eager.pos) and torch.equal(comp.mask, eager.mask)
        assert sum(counters["graph_break"].values()) == breaks


def test_usage_recipe_matches_generate_on_cpu(monkeypatch):
    """The code of docs/usage.md "Fastest decode with CUDA graphs", run as written on the CPU (torch.cuda's stream and
    graph calls stubbed: "replay" runs the compiled step), gives the greedy tokens of generate() for two prompts of
    different lengths through the one compiled step."""
    import contextlib
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")
    with open(path) as f:
        text = f.read()
    section = text[text.index("### Fastest decode with CUDA graphs") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "cache.reset()" in code and "torch.compile(step" in code and "graph.replay()" in code

    namespace = {}

    class _Graph:
        def replay(self):
            namespace["compiled_step"]()

    class _Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())

    model = _kbit_llama(3, fused=False, seed=3)
    torch._dynamo.reset()
    gen_kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    for n, (prompt_len, new) in enumerate([(7, 6), (4, 5)]):
        input_ids = torch.randint(1, 128, (2, prompt_len), generator=seeded("recipe", n))
        if n == 0:
            namespace.update(model=model, batch_size=2, input_ids=input_ids, max_new_tokens=new)
            exec(code.replace("max_len = 2048", "max_len = 32"), namespace)  # noqa: S102  (the documented code)
            generated = namespace["generated"]
        else:  # the same compiled step for another prompt: prefill, then replay
            ns = namespace
            with torch.no_grad():
                ns["prefill"](input_ids)
                out = [ns["tok"].clone()]
                for _ in range(new - 1):
                    ns["graph"].replay()
                    out.append(ns["tok"].clone())
            generated = torch.cat(out, dim=1)
        with torch.no_grad():
            ref = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=new,
                min_new_tokens=new,
                output_scores=True,
                return_dict_in_generate=True,
                **gen_kwargs,
            )
        _assert_same_greedy_tokens(generated, ref.sequences[:, prompt_len:], ref.scores, n)


def _assert_same_greedy_tokens(got, ref, scores, what):
    """Each sequence's tokens equal generate()'s, or up to a first difference where generate()'s logits are a near-tie
    between the two tokens (margin within the rounding bound of the module docstring); after it the histories
    differ, so the rest of that sequence is not compared."""
    assert got.shape == ref.shape
    for b in range(got.shape[0]):
        diff = (got[b] != ref[b]).nonzero()
        if diff.numel() == 0:
            continue
        i = int(diff[0])
        logits = scores[i][b].float()
        margin = (logits[ref[b, i]] - logits[got[b, i]]).item()
        bound = 4 * 2**-8 * logits.abs().max().item()
        assert margin <= bound, (
            f"{what}: sequence {b} parts from generate() at token {i}, margin {margin:.3g} > {bound:.3g}"
        )

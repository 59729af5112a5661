"""transformers cases of issue 66: codebooks in the config, corrupted k-bit checkpoints, GPT-2 Conv1D layers, parameter
counts."""

import copy
import os

import pytest
import torch
from conftest import seeded, tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from bitsandbytes_kbit import integrations
from bitsandbytes_kbit.integrations import BitsAndBytesKbitConfig
from bitsandbytes_kbit.nn import LinearKbit

assert integrations.register()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("robust-llama")
    tiny_llama(seed=3).save_pretrained(path)
    return path


def _load(path, **config):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesKbitConfig(**config), dtype=torch.bfloat16, device_map={"": "cpu"}
    )


IDS = torch.tensor([[1, 17, 42, 99, 7, 3]])


@pytest.mark.parametrize(
    "config",
    [
        {"bnb_kbit_bits": 4, "bnb_kbit_codebook": "fp4"},
        {"bnb_kbit_bits": 3, "bnb_kbit_codebook": [-1.0, -0.4, -0.1, 0.0, 0.15, 0.5, 1.0]},
    ],
    ids=["fp4", "list"],
)
def test_codebook_configs_quantize_save_and_reload(config, llama_dir, tmp_path):
    model = _load(llama_dir, **config)
    layers = [m for m in model.modules() if isinstance(m, LinearKbit)]
    assert layers and all(m.is_quantized and m.codebook.dtype == torch.float32 for m in layers)
    with torch.no_grad():
        logits = model(IDS).logits
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map={"": "cpu"})
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, logits)


def test_non_numeric_codebook_list_is_a_clear_error():
    with pytest.raises(ValueError, match=r"bnb_kbit_codebook=\[-1.0, 'a', 1.0\].*expected.*list of numbers"):
        BitsAndBytesKbitConfig(bnb_kbit_bits=2, bnb_kbit_codebook=[-1.0, "a", 1.0])
    with pytest.raises(TypeError, match=r"bnb_kbit_codebook=5.*expected"):
        BitsAndBytesKbitConfig(bnb_kbit_bits=2, bnb_kbit_codebook=5)
    for bits in (4.0, "4", True):
        with pytest.raises(TypeError, match=rf"BitsAndBytesKbitConfig: bnb_kbit_bits={bits!r} is a .*expected an int"):
            BitsAndBytesKbitConfig(bnb_kbit_bits=bits)


@pytest.fixture(scope="module")
def kbit_checkpoint(llama_dir, tmp_path_factory):
    """A k = 3 checkpoint of the tiny Llama (uniform codebook: 7 levels, fewer than 2^3), its one safetensors file's
    tensors and the logits of the model that wrote it."""
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("robust-kbit")
    model = _load(llama_dir, bnb_kbit_bits=3, bnb_kbit_codebook="uniform")
    model.save_pretrained(path)
    with torch.no_grad():
        logits = model(IDS).logits
    (name,) = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return path, name, load_file(path / name), logits


Q = "model.layers.0.self_attn.q_proj"


def _uniform_3bit_codebook_too_short(sd):
    sd[f"{Q}.codebook"] = sd[f"{Q}.codebook"][:3].clone()  # the weight holds indices up to 6


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda sd: sd.pop(f"{Q}.absmax"), rf"lacks {Q}.absmax"),
        (lambda sd: sd.pop(f"{Q}.codebook"), rf"lacks {Q}.codebook"),
        (lambda sd: sd.pop(f"{Q}.kbit_format"), rf"lacks {Q}.kbit_format"),
        (lambda sd: sd.update({f"{Q}.weight": sd[f"{Q}.weight"][:-3].clone()}), r"weight|size"),
        (_uniform_3bit_codebook_too_short, r"codebook|size"),
        (
            lambda sd: sd.update({f"{Q}.kbit_format": torch.tensor([1, 7, *sd[f"{Q}.kbit_format"][2:].tolist()])}),
            rf"{Q}.kbit_format: k=7 is not supported",
        ),
        (
            lambda sd: sd.update({f"{Q}.codebook": sd[f"{Q}.codebook"].flip(0).contiguous()}),
            rf"{Q}.codebook is not in ascending order",
        ),
    ],
    ids=["no-absmax", "no-codebook", "no-format", "truncated-weight", "short-codebook", "k7", "unsorted-codebook"],
)
def test_corrupted_kbit_checkpoint_is_refused_by_from_pretrained(edit, message, kbit_checkpoint, tmp_path):
    """transformers loads a k-bit checkpoint's tensors itself (not through LinearKbit.load_state_dict) and only logs a
    missing one as newly initialized: the quantizer refuses every such checkpoint, naming the tensor. (A truncated
    weight or a shorter codebook may be refused by transformers' own size check first.)"""
    import shutil

    from safetensors.torch import save_file

    path, name, tensors, _ = kbit_checkpoint
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    sd = dict(tensors)
    edit(sd)
    save_file(sd, tmp_path / name, metadata={"format": "pt"})
    with pytest.raises((ValueError, RuntimeError), match=message):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map={"": "cpu"})


def test_intact_kbit_checkpoint_loads_bit_identical(kbit_checkpoint):
    path, _, _, logits = kbit_checkpoint
    again = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": "cpu"})
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, logits)


def _tiny_gpt2(seed=0):
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_conv1d_layers_are_quantized(tmp_path):
    from transformers.pytorch_utils import Conv1D

    float_model = _tiny_gpt2()
    float_model.save_pretrained(tmp_path / "float")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float",
        quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4),
        dtype=torch.float32,
        device_map={"": "cpu"},
    )
    assert not any(isinstance(m, Conv1D) for m in model.modules())
    converted = {n: m for n, m in model.named_modules() if isinstance(m, LinearKbit)}
    assert len(converted) == 2 * 4  # c_attn, c_proj, c_fc, mlp.c_proj per layer
    # each LinearKbit holds the transposed Conv1D weight ([nf, nx] as nn.Linear), quantized
    for name, module in converted.items():
        conv = float_model.get_submodule(name)
        assert (module.in_features, module.out_features) == tuple(conv.weight.shape)
        W = conv.weight.detach().t()
        err = (module.dequantize(torch.float32) - W).abs()
        assert float(err.max()) <= 0.5 * float(W.abs().max())  # quantized from the right (transposed) weight
        x = torch.randn(3, module.in_features, generator=seeded("gpt2", name))
        ref = x.double() @ module.dequantize(torch.float32).double().t() + module.bias.double()
        assert torch.allclose(module(x).double(), ref, atol=1e-4)
    with torch.no_grad():
        logits = model(IDS % 96).logits
    model.save_pretrained(tmp_path / "kbit")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "kbit", dtype=torch.float32, device_map={"": "cpu"}
    )
    assert sum(isinstance(m, LinearKbit) for m in again.modules()) == len(converted)
    with torch.no_grad():
        assert torch.equal(again(IDS % 96).logits, logits)


def test_num_parameters_is_the_logical_count(llama_dir, tmp_path):
    """model.num_parameters() of a k-bit model equals the float model's (every option), after save and reload, a
    deepcopy and a pickle round trip; under PEFT it adds exactly the LoRA parameters; dequantize() gives it back to
    transformers. sum(p.numel()) stays the storage count (as with bitsandbytes' 4-bit models)."""
    import pickle

    import peft

    float_model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    model = _load(llama_dir, bnb_kbit_bits=3)
    layers = [m for m in model.modules() if isinstance(m, LinearKbit)]
    assert layers and all(m.is_quantized for m in layers)
    quantized = sum(m.out_features * m.in_features for m in layers)
    assert sum(p.numel() for p in model.parameters()) < float_model.num_parameters()
    for options in ({}, {"exclude_embeddings": True}):
        assert model.num_parameters(**options) == float_model.num_parameters(**options), options
    assert model.num_parameters(only_trainable=True) == float_model.num_parameters(only_trainable=True) - quantized
    model.save_pretrained(tmp_path / "kbit")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "kbit", dtype=torch.bfloat16)
    assert again.num_parameters() == float_model.num_parameters()
    assert copy.deepcopy(model).num_parameters() == float_model.num_parameters()
    assert pickle.loads(pickle.dumps(model)).num_parameters() == float_model.num_parameters()
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8, lora_dropout=0.0)
    )
    trainable, _ = lora.get_nb_trainable_parameters()
    assert trainable == sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n) > 0
    assert lora.num_parameters() == float_model.num_parameters() + trainable
    plain = again.dequantize()
    assert "num_parameters" not in plain.__dict__ and plain.num_parameters() == float_model.num_parameters()

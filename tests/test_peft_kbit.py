"""PEFT LoRA on LinearKbit (CPU): training lowers the loss, adapters save and reload, merge behaviour."""

import os
import warnings

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported; the [test] extra installs it
import peft
import transformers
from conftest import seeded, tiny_llama

from bitsandbytes_kbit import integrations
from bitsandbytes_kbit.integrations import BitsAndBytesKbitConfig
from bitsandbytes_kbit.integrations.peft import LoraLinearKbit, register_lora_kbit
from bitsandbytes_kbit.nn import LinearKbit

assert integrations.register()

N_LINEAR = 14


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-float-peft")
    tiny_llama().save_pretrained(path)
    return path


def load_kbit(path, k=4):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=k), dtype=torch.float32, device_map={"": "cpu"}
    )  # CPU tests, also on a machine with a GPU


def get_peft_model(model, config, seed=0):
    """PEFT initializes lora_A from the global RNG: seed it per test, without touching the global state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def lora_config(**kwargs):
    kwargs = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear", **kwargs}
    return peft.LoraConfig(**kwargs)


def batch():
    ids = torch.randint(0, 128, (4, 12), generator=seeded("peft-batch"))
    return ids


def train(model, steps=4):
    ids = batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def kbit_state(model):
    return {n: t.clone() for n, t in model.state_dict().items() if "lora_" not in n and not n.endswith("bias")}


def with_adapter_weights(model):
    """LoRA B is zero-initialised; give it values so merges change something."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=seeded("lora-B", name)) * 0.05)
    return model


def test_all_linear_finds_kbit_layers_and_training_lowers_the_loss(float_dir, tmp_path):
    model = get_peft_model(load_kbit(float_dir), lora_config())
    wrapped = [m for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(wrapped) == N_LINEAR and all(isinstance(m.get_base_layer(), LinearKbit) for m in wrapped)
    frozen_before = kbit_state(model)
    losses = train(model)
    assert losses[-1] < losses[0] - 0.05, losses
    # The k-bit weights never change and never get gradients.
    for name, value in kbit_state(model).items():
        assert torch.equal(value, frozen_before[name]), name
    assert all(m.get_base_layer().weight.grad is None for m in wrapped)

    # Adapter save -> reload on a freshly quantized base gives the same outputs.
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
    ids = batch()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    reloaded = peft.PeftModel.from_pretrained(load_kbit(float_dir), tmp_path)
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


def test_generic_merge_fails_without_corrupting(float_dir):
    model = with_adapter_weights(get_peft_model(load_kbit(float_dir), lora_config(target_modules=["q_proj"])))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer) is peft.tuners.lora.Linear  # PEFT's generic wrapper
    before = kbit_state(model)
    for safe_merge in (False, True):
        with pytest.raises(RuntimeError):
            layer.merge(safe_merge=safe_merge)
    with pytest.raises(RuntimeError):
        model.merge_and_unload()
    assert not layer.merged
    for name, value in kbit_state(model).items():
        assert torch.equal(value, before[name]), name


def test_registered_lora_merges_by_requantizing(float_dir, tmp_path):
    config = register_lora_kbit(lora_config())
    model = with_adapter_weights(get_peft_model(load_kbit(float_dir), config))
    layers = [m for m in model.modules() if isinstance(m, LoraLinearKbit)]
    assert len(layers) == N_LINEAR
    train(model, steps=1)  # the forward/backward of the subclass works too
    model.eval()
    ids = batch()
    with torch.no_grad():
        unmerged = model(input_ids=ids).logits

    # The merged layer holds exactly the k-bit quantization of W + delta.
    layer = layers[0]
    base = layer.get_base_layer()
    target = base.dequantize(torch.float32) + layer.get_delta_weight("default").float()
    expected = LinearKbit.from_linear(_linear_with(target), k=base.k)
    with pytest.warns(UserWarning, match="re-quantizes"):
        layer.merge()
    assert layer.merged and torch.equal(base.weight, expected.weight) and torch.equal(base.absmax, expected.absmax)
    assert base.weight.dtype == torch.int32 and base.codebook.dtype == torch.float32
    layer.unmerge()
    assert not layer.merged

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        merged = model.merge_and_unload()
    assert sum(isinstance(m, LinearKbit) for m in merged.modules()) == N_LINEAR
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
    # Merging re-quantizes: close to the unmerged model, within k-bit quantization error of the delta.
    rel = (merged_logits - unmerged).norm() / unmerged.norm()
    assert rel < 0.1, rel


def _linear_with(weight):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


def test_registered_adapter_reload_with_config(float_dir, tmp_path):
    config = register_lora_kbit(lora_config(target_modules=["v_proj", "down_proj"]))
    model = with_adapter_weights(get_peft_model(load_kbit(float_dir), config))
    model.save_pretrained(tmp_path)
    model.eval()
    ids = batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    reload_config = register_lora_kbit(peft.LoraConfig.from_pretrained(tmp_path))
    reloaded = peft.PeftModel.from_pretrained(load_kbit(float_dir), tmp_path, config=reload_config)
    assert any(isinstance(m, LoraLinearKbit) for m in reloaded.modules())
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)


@pytest.mark.parametrize("registered", [False, True], ids=["generic", "registered"])
def test_dora_is_refused_up_front(float_dir, registered):
    """DoRA needs the float base weight when the adapter is created; PEFT reads the packed int32 weight
    (its dequantize helper knows only bnb, HQQ and torchao) and fails: an error, never a silent model."""
    config = lora_config(target_modules=["o_proj"], use_dora=True)
    if registered:
        config = register_lora_kbit(config)
    with pytest.raises(RuntimeError):
        get_peft_model(load_kbit(float_dir), config)


@pytest.mark.cuda
def test_cuda_lora_training_step_and_adapter_reload(float_dir, tmp_path):
    """LoRA on a model loaded with load_in_kbit on the GPU: the loss falls, the k-bit weights stay
    unchanged, and the saved adapter reloads to the same logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4), dtype=torch.bfloat16, device_map="cuda"
    )
    peft_model = get_peft_model(model, lora_config())
    before = kbit_state(peft_model)
    ids = batch().cuda()
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(6):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    after = kbit_state(peft_model)
    assert all(torch.equal(before[n], after[n]) for n in before if n in after)
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=4), dtype=torch.bfloat16, device_map="cuda"
    )
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, expected)

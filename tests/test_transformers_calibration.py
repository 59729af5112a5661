"""The calibrated load path of the transformers integration (``bnb_kbit_calibration="gptq"``) on a tiny random
Llama on the CPU: load in float -> GPTQ -> LinearKbit; save -> reload needs no calibration."""

import copy
import os

import pytest
import torch
from conftest import requires_cuda, tiny_llama
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from bitsandbytes_kbit import calibration, integrations
from bitsandbytes_kbit.integrations import BitsAndBytesKbitConfig
from bitsandbytes_kbit.nn import LinearKbit

assert integrations.register()

K = 2


class CharTokenizer:
    """A stand-in tokenizer: one id per character (no downloads)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, return_tensors=None):
        return {"input_ids": torch.tensor([[ord(c) % self.vocab for c in text]])}


TEXTS = ["The quick brown fox jumps over the lazy dog. " * 4, "Pack my box with five dozen liquor jugs! " * 4]


def gptq_config(**kwargs):
    return BitsAndBytesKbitConfig(
        bnb_kbit_bits=K,
        bnb_kbit_calibration="gptq",
        bnb_kbit_calibration_texts=TEXTS,
        bnb_kbit_calibration_tokenizer=CharTokenizer(128),
        bnb_kbit_calibration_samples=4,
        bnb_kbit_calibration_seq_len=40,
        **kwargs,
    )


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-float-cal")
    tiny_llama(seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def calibrated(float_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=gptq_config(), dtype=torch.float32, device_map={"": "cpu"}
    )


def test_calibrated_load_equals_calibrate_model(calibrated, float_dir):
    names = [n for n, m in calibrated.named_modules() if isinstance(m, LinearKbit)]
    assert len(names) == 14 and type(calibrated.lm_head) is nn.Linear
    # the same calibration run by hand on the float model
    ref = tiny_llama(seed=3)
    samples = calibration.calibration_samples(CharTokenizer(128), TEXTS, num_samples=4, seq_len=40)
    expected = calibration.calibrate_model(ref, K, samples=samples, progress=False)
    assert sorted(expected) == sorted(names)
    for n in names:
        got = calibrated.get_submodule(n).dequantize(torch.float32)
        assert (got == expected[n].dequantize()).float().mean() > 0.99
    # and it is not the data-free quantization
    data_free = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir,
        quantization_config=BitsAndBytesKbitConfig(bnb_kbit_bits=K),
        dtype=torch.float32,
        device_map={"": "cpu"},
    )
    differ = [
        not torch.equal(calibrated.get_submodule(n).dequantize(), data_free.get_submodule(n).dequantize())
        for n in names
    ]
    assert sum(differ) >= len(names) - 2


def test_calibrated_checkpoint_reloads_without_calibration(calibrated, tmp_path, monkeypatch):
    calibrated.save_pretrained(tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("a pre-quantized load must not calibrate")

    monkeypatch.setattr(calibration, "calibrate_model", fail)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": "cpu"})
    cfg = again.config.quantization_config
    assert cfg.bnb_kbit_calibration == "gptq" and cfg.bnb_kbit_calibration_texts is None
    ids = torch.tensor([[1, 17, 42, 99, 7, 3, 60]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, calibrated(ids).logits)
    for n, m in calibrated.named_modules():
        if isinstance(m, LinearKbit):
            assert torch.equal(again.get_submodule(n).dequantize(), m.dequantize())


def test_calibration_config_round_trip_and_checks():
    d = gptq_config().to_dict()
    assert d["bnb_kbit_calibration"] == "gptq" and d["bnb_kbit_calibration_tokenizer"] is None
    assert BitsAndBytesKbitConfig.from_dict(copy.deepcopy(d)).to_dict() == d
    assert BitsAndBytesKbitConfig().bnb_kbit_calibration is None  # data-free by default
    with pytest.raises(ValueError, match="bnb_kbit_calibration='awq'"):
        BitsAndBytesKbitConfig(bnb_kbit_calibration="awq")
    with pytest.raises(ValueError, match="bnb_kbit_calibration_texts is set"):
        BitsAndBytesKbitConfig(bnb_kbit_calibration_texts=["some text"])
    with pytest.raises(ValueError, match="bnb_kbit_calibration_texts="):
        BitsAndBytesKbitConfig(bnb_kbit_calibration="gptq", bnb_kbit_calibration_texts="one string")
    with pytest.raises(ValueError, match="bnb_kbit_calibration_samples=0"):
        BitsAndBytesKbitConfig(bnb_kbit_calibration="gptq", bnb_kbit_calibration_samples=0)
    with pytest.raises(ValueError, match="bnb_kbit_calibration_damp=-1"):
        BitsAndBytesKbitConfig(bnb_kbit_calibration="gptq", bnb_kbit_calibration_damp=-1)
    with pytest.raises(TypeError, match="bnb_kbit_calibration_tokenizer is a int"):
        BitsAndBytesKbitConfig(bnb_kbit_calibration="gptq", bnb_kbit_calibration_tokenizer=3)
    with pytest.raises(ValueError, match="scale_method='absmax'"):
        BitsAndBytesKbitConfig(bnb_kbit_calibration="gptq", bnb_kbit_scale_method="absmax")


@pytest.mark.cuda
@requires_cuda
def test_cuda_calibrated_load_and_reload(float_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=gptq_config(), dtype=torch.bfloat16, device_map={"": "cuda"}
    )
    assert all(m.weight.device.type == "cuda" for m in model.modules() if isinstance(m, LinearKbit))
    ids = torch.tensor([[1, 17, 42, 99, 7, 3, 60]], device="cuda")
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"": "cuda"})
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)

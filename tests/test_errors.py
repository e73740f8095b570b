"""Every refused input is a typed EngineError naming the problem, and the engine keeps working."""

from __future__ import annotations

import json
import shutil

import pytest
from util import make_checkpoint

from engine import Engine, EngineError, SamplingParams
from engine.api.options import SpeculationConfig
from engine.core.checkpoint import load_model
from engine.core.errors import (
    CheckpointError,
    InvalidConfigError,
    InvalidRequestError,
    UnsupportedArchitectureError,
    VocabMismatchError,
)


@pytest.fixture()
def broken(ckpt_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir, d)
    return d


def _cfg(d):
    return json.loads((d / "config.json").read_text())


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(broken)


def test_invalid_config_json(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable config.json"):
        load_model(broken)


def test_config_missing_field(broken):
    c = _cfg(broken)
    del c["hidden_size"]
    (broken / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(broken)


def test_unsupported_architecture(broken):
    c = _cfg(broken)
    c["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(c))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(broken)


def test_missing_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load_model(broken)


def test_truncated_safetensors(broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(broken)


def test_corrupt_safetensors_header(broken):
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(broken)


def _rewrite(d, fn):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(broken):
    _rewrite(broken, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_model(broken)


def test_misshaped_tensor(broken):
    def cut(sd):
        sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"][:, :10].clone()

    _rewrite(broken, cut)
    with pytest.raises(CheckpointError, match=r"q_proj.weight has shape \(64, 10\), expected \(64, 64\)"):
        load_model(broken)


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        Engine.from_pretrained(broken)


def test_sharded_checkpoint_loads(ckpt_dir, tmp_path):
    import torch
    import transformers as tf

    m = tf.LlamaForCausalLM.from_pretrained(ckpt_dir)
    m.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    x = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.allclose(load_model(tmp_path)(x), m(x).logits, atol=1e-5)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match="shard file"):
        load_model(tmp_path)


def test_vocab_mismatch(ckpt_dir, tmp_path):
    other = make_checkpoint(tmp_path / "other", vocab_size=280, hidden_size=32, num_hidden_layers=1)
    with pytest.raises(VocabMismatchError, match="280.*300|300.*280"):
        Engine.from_pretrained(ckpt_dir, other)


def test_unknown_drafter_and_bad_k(ckpt_dir):
    with pytest.raises(InvalidConfigError, match="drafter='hydra'.*model, ngram, early-exit, medusa, eagle"):
        Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="hydra"))
    with pytest.raises(InvalidConfigError, match="k=0.*>= 1"):
        Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=0))
    with pytest.raises(InvalidConfigError, match="device"):
        Engine.from_pretrained(ckpt_dir, device="tpu")


@pytest.fixture(scope="module")
def engine(ckpt_dir):
    return Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=3))


BAD_REQUESTS = [
    ("empty string", "", None, "empty"),
    ("empty id list", [[]], None, "empty"),
    ("empty prompt list", [], None, "prompts"),
    ("token id >= vocab", [[1, 2, 300]], None, r"prompts\[0\]\[2\]=300.*0\.\.299"),
    ("negative token id", [[-1, 2]], None, r"prompts\[0\]\[0\]=-1"),
    ("non-int token", [[1, 2.5]], None, r"prompts\[0\]\[1\]"),
    ("wrong prompt type", 42, None, "prompts"),
    ("wrong element type", [{"a": 1}], None, r"prompts\[0\]"),
    ("prompt too long", [[1] * 510], SamplingParams(max_new_tokens=5), "510 tokens.*512"),
    ("max_new_tokens beyond context", [[1, 2]], SamplingParams(max_new_tokens=600), "602.*512"),
    ("params count", ["a", "b"], [SamplingParams()], "params has 1 entries for 2 prompts"),
    ("params type", ["a"], {"temperature": 1}, "params"),
]


@pytest.mark.parametrize("name,prompts,params,match", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_then_engine_still_works(engine, name, prompts, params, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        engine.generate(prompts, params)
    assert isinstance(e.value, EngineError) and isinstance(e.value, ValueError)
    good = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8))[0]
    ref = Engine.generate(engine, [[5, 6, 7]], SamplingParams(max_new_tokens=8))[0]
    assert good.token_ids == ref.token_ids and 1 <= len(good.token_ids) <= 8


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("max_new_tokens", 0, "max_new_tokens"),
        ("seed", "abc", "seed"),
        ("stop", "END", "stop"),
        ("stop", [1], "stop"),
    ],
)
def test_bad_sampling_params(field, value, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**{field: value})

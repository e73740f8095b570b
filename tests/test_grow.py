"""Growing a model's width by unit duplication: the same function, a wider model (engine/demo/grow.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from util import llama_config

from engine.core.checkpoint import load_model
from engine.core.errors import InvalidConfigError
from engine.core.model import Transformer
from engine.demo import recipe, train
from engine.demo.grow import grow_width, grown_config
from engine.train.distill import round_weights


def _model(heads: int, kv_heads: int, seed: int = 0) -> Transformer:
    cfg = llama_config(
        vocab_size=300,
        hidden_size=32 * heads,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with torch.no_grad():
        for p in m.parameters():  # gains away from 1, weights large enough to matter
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * 0.1)
    return m.eval()


@pytest.mark.parametrize("factor", [2, 4])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)], ids=["mha", "gqa"])
def test_grown_model_computes_the_same_logits(factor: int, heads: int, kv_heads: int) -> None:
    narrow = _model(heads, kv_heads)
    wide = grow_width(narrow, factor)
    c = wide.config
    assert (c.hidden_size, c.intermediate_size) == (32 * heads * factor, 80 * factor)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (heads * factor, kv_heads * factor, 32)
    assert sum(p.numel() for p in wide.parameters()) > factor * sum(p.numel() for p in narrow.parameters())
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = narrow(ids), wide(ids)
    assert b.abs().max() > 1.0  # a real signal, not a vanishing one
    torch.testing.assert_close(b, a, atol=2e-5, rtol=2e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert wide.lm_head.weight is wide.embed_tokens.weight


def test_bf16_values_stay_bf16_values() -> None:
    narrow = _model(2, 2)
    round_weights(narrow, "bfloat16")
    for name, p in grow_width(narrow, 4).named_parameters():
        assert torch.equal(p, p.bfloat16().float()), name


def test_invalid_factors_are_refused() -> None:
    cfg = _model(2, 2).config
    for bad in (0, 3, 6):
        with pytest.raises(ValueError, match=f"factor={bad} is invalid"):
            grown_config(cfg, bad)
    demo = recipe.get_recipe("demo")
    with pytest.raises(InvalidConfigError, match="grow=3 is invalid"):
        recipe.trained_shape(replace(demo, grow=3))
    with pytest.raises(InvalidConfigError, match="grow=64 is invalid"):  # 12 heads do not split 64 ways
        recipe.trained_shape(replace(demo, grow=64))


def test_a_pair_with_a_grown_target(tmp_path: Path) -> None:
    """build_pair trains the target narrow, distils the draft from it, and saves the grown target:
    a Hugging Face checkpoint of the grown shape whose logits transformers reproduces."""
    from transformers import LlamaForCausalLM

    tiny = recipe.get_recipe("tiny")
    r = replace(tiny, grow=2, target_steps=20, draft=replace(tiny.draft, steps=10, samples=8, gen_len=16))
    rep = train.build_pair(r, tmp_path, progress=False, size="grown")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["draft", "target"]
    cfg = json.loads((tmp_path / "target" / "config.json").read_text(encoding="utf-8"))
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]) == (192, 512, 4)
    target = load_model(tmp_path / "target", dtype=torch.float32)
    assert rep["target"]["params"] == sum(p.numel() for p in target.parameters())
    assert rep["target"]["trained_params"] < rep["target"]["params"] / 3
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "target"), dtype=torch.float32).eval()
    ids = torch.randint(0, r.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(target(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)

"""Drafts by Hub id, offline from a local huggingface_hub cache: a head trained here and an EAGLE-3 head in its
authors' layout with pickled weights load as from their directories and draft the same tokens."""

from __future__ import annotations

import json

import pytest
from test_chat_hub_detok import _fake_hub_cache
from test_eagle3_formats import synthetic_state, write_layout
from test_heads import random_head
from util import PROMPTS

from engine import Engine, SamplingParams
from engine.api.options import SpeculationConfig
from engine.core.errors import CheckpointError, InvalidConfigError
from engine.core.hub import HubOptions, resolve_model


def _same_drafts(target, local, ref: str, drafter: str, hub: HubOptions) -> None:
    spec = SpeculationConfig(drafter=drafter, k=3, k_policy="constant")
    sp = SamplingParams(max_new_tokens=16)
    by_id = Engine.from_pretrained(target, ref, speculation=spec, hub=hub)
    there = Engine.from_pretrained(target, local, speculation=spec)
    plain = Engine.from_pretrained(target)
    want = [o.token_ids for o in plain.generate(PROMPTS[:3], sp)]
    assert [o.token_ids for o in by_id.generate(PROMPTS[:3], sp)] == want
    assert [o.token_ids for o in there.generate(PROMPTS[:3], sp)] == want
    got, exp = by_id.stats(), there.stats()
    assert got["drafted"] == exp["drafted"] > 0 and got["accepted"] == exp["accepted"]  # the same head drafted


def test_a_head_trained_here_by_hub_id(ckpt_dir, tmp_path):
    head = random_head(ckpt_dir, tmp_path / "head", "eagle", scale=1.0)
    _fake_hub_cache(tmp_path / "hub", "acme/eagle-head", head)
    hub = HubOptions(cache_dir=tmp_path / "hub", offline=True)
    _same_drafts(ckpt_dir, head, "acme/eagle-head", "eagle", hub)
    spec = SpeculationConfig(drafter="eagle")
    with pytest.raises(CheckpointError, match="acme/nothing.*offline"):
        Engine.from_pretrained(ckpt_dir, "acme/nothing", speculation=spec, hub=hub)
    with pytest.raises(InvalidConfigError, match="hub.offline"):
        HubOptions(offline="yes")


def test_an_authors_eagle3_head_with_pickled_weights_by_hub_id(ckpt_dir, tmp_path):
    from engine.cli.serve import _draft_kind

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    path = write_layout(tmp_path / "h", "authors-bin", synthetic_state(H, V, 50, 0), H, V, 50)
    _fake_hub_cache(tmp_path / "hub", "acme/eagle3", path)
    hub = HubOptions(cache_dir=tmp_path / "hub", offline=True)
    _same_drafts(ckpt_dir, path, "acme/eagle3", "eagle3", hub)
    got = resolve_model("acme/eagle3", cache_dir=tmp_path / "hub", offline=True, draft=True)
    assert (got / "pytorch_model.bin").is_file() and _draft_kind(got) == "eagle3"  # serve infers the drafter
    with pytest.raises(CheckpointError, match="no .safetensors"):  # pickled weights only for a draft
        resolve_model("acme/eagle3", cache_dir=tmp_path / "hub", offline=True)

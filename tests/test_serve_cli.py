"""specmix-serve's loading: the drafter a --draft implies (a trained head or a draft model) and the
checkpoint's generation_config.json defaults, each bad file a typed error."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from test_heads import random_head

from engine.cli.serve import build_parser, generation_defaults, load
from engine.core.errors import CheckpointError

OLD_PROFILE = Path(__file__).resolve().parent / "data" / "profile-schema1-tiny.json"  # schema 1, the tiny demo pair


def _load(*argv: str):
    eng, name, _ = load(build_parser().parse_args(list(argv)))
    return eng, name


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_head_directory_as_draft_serves_with_its_kind(ckpt_dir, tmp_path, kind):
    head = random_head(ckpt_dir, tmp_path / kind, kind)
    eng, name = _load("--target", str(ckpt_dir), "--draft", str(head), "--k-policy", "constant", "--k", "3")
    assert eng.info["drafter"] == kind and name == str(ckpt_dir)
    out = eng.generate([[5, 6, 7]], None)[0]
    assert out.stats["draft_trials"] > 0  # the head drafted


def test_a_draft_model_and_no_spec(ckpt_dir, draft_dir):
    eng, _ = _load("--target", str(ckpt_dir), "--draft", str(draft_dir))
    assert eng.info["drafter"] == "model"
    eng, _ = _load("--target", str(ckpt_dir), "--draft", str(draft_dir), "--no-spec")
    assert eng.info.get("drafter") is None


def test_generation_defaults(tmp_path):
    assert generation_defaults(tmp_path) == {}
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"do_sample": False, "temperature": 0.7, "top_p": 0.9}), encoding="utf-8")
    got = generation_defaults(tmp_path)
    assert got["temperature"] == 0.0 and got["top_p"] == 0.9
    for bad in ("[1, 2]", "{not json"):
        f.write_text(bad, encoding="utf-8")
        with pytest.raises(CheckpointError, match="generation_config.json"):
            generation_defaults(tmp_path)


def test_serving_a_profile_logs_its_file_and_plan(ckpt_dir, tmp_path, monkeypatch, caplog):
    """The startup line reads the engine's Profile: its file and its plan (no server started)."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    import uvicorn

    from engine import Engine
    from engine.api.profile import Profile
    from engine.cli import serve

    path = tmp_path / "p.json"
    prof = Profile.from_dict(json.loads(OLD_PROFILE.read_text(encoding="utf-8")), str(OLD_PROFILE))
    eng = Engine.from_pretrained(ckpt_dir)
    eng.profile = dataclasses.replace(prof, path=path)
    monkeypatch.setattr(serve, "load", lambda args: (eng, "p", None))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    with caplog.at_level(logging.INFO):
        assert serve.main(["--profile", str(path)]) == 0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model p:"))
    assert f"profile {path}, plan {json.dumps(prof.plan.to_dict())[:200]}" in line


def test_trees_from_the_command_line(ckpt_dir):
    from engine.core.errors import InvalidConfigError

    eng, _ = _load("--target", str(ckpt_dir), "--drafter", "ngram", "--tree-branches", "3")
    assert eng.drafter.branches == 3 and eng.policy.trees
    plain, _ = _load("--target", str(ckpt_dir), "--drafter", "ngram")
    assert plain.drafter.branches == 1 and not plain.policy.trees
    with pytest.raises(InvalidConfigError, match="suffix_global_tokens"):  # read by the suffix drafter only
        _load("--target", str(ckpt_dir), "--drafter", "ngram", "--suffix-global-tokens", "0")
    with pytest.raises(InvalidConfigError, match="tree_branches=9 is invalid"):
        _load("--target", str(ckpt_dir), "--drafter", "ngram", "--tree-branches", "9")


def test_the_suffix_drafters_global_tree_from_the_command_line(ckpt_dir):
    pytest.importorskip("arctic_inference", reason="the suffix extra")
    eng, _ = _load("--target", str(ckpt_dir), "--drafter", "suffix", "--suffix-global-tokens", "0")
    assert eng.drafter.index is None  # each request drafts from its own tokens only
    shared, _ = _load("--target", str(ckpt_dir), "--drafter", "suffix")
    assert shared.drafter.index is not None
    off, _ = _load("--target", str(ckpt_dir), "--drafter", "suffix", "--suffix-global-tokens", "0", "--no-spec")
    assert off.drafter is None  # --no-spec leaves the drafter's flags unread: one command line serves on and off


def test_the_draft_cut_from_the_command_line(ckpt_dir):
    from engine.core.errors import InvalidConfigError

    eng, _ = _load("--target", str(ckpt_dir), "--drafter", "ngram", "--no-draft-cut")
    assert not eng.policy.draft_cut
    on, _ = _load("--target", str(ckpt_dir), "--drafter", "ngram")
    assert on.policy.draft_cut
    off, _ = _load("--target", str(ckpt_dir), "--drafter", "ngram", "--no-draft-cut", "--no-spec")
    assert off.drafter is None  # one command line serves on and off
    with pytest.raises(InvalidConfigError, match="--no-draft-cut invalid with --profile"):
        _load("--profile", str(OLD_PROFILE), "--no-draft-cut")

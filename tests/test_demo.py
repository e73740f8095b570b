"""The embedded demo pair (engine.demo), on the tiny size built once per session."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from engine.core.checkpoint import load_model
from engine.core.errors import InvalidConfigError
from engine.core.tokenizer import Tokenizer
from engine.demo import evaluate as demo_evaluate
from engine.demo import pair, recipe

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("specmix-cache")


@pytest.fixture(scope="session")
def tiny_pair(tiny_cache: Path) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the tiny demo pair, built once into a temporary cache."""
    return pair.demo_pair("tiny", cache_dir=tiny_cache, progress=False)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- corpus


def test_splits_are_disjoint_and_cover_the_corpus() -> None:
    t = recipe.demo_texts()
    text = recipe.corpus_text()
    assert t["train"] + t["heldout"] == text
    assert t["train"].endswith("\n")  # cut at a line boundary
    assert 0.09 < len(t["heldout"]) / len(text) < 0.11
    assert t["train"].endswith(t["calib"]) and 0.04 < len(t["calib"]) / len(t["train"]) < 0.06
    assert t["calib"] not in t["heldout"] and t["heldout"] not in t["train"]
    # few long held-out lines appear in the training text (the docs repeat some; ~7%)
    lines = [ln for ln in t["heldout"].splitlines() if len(ln) > 60]
    assert len(lines) > 50
    assert sum(ln in t["train"] for ln in lines) < 0.15 * len(lines)


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECMIX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert recipe.default_cache_dir() == tmp_path / "xdg" / "specmix"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert recipe.default_cache_dir() == Path.home() / ".cache" / "specmix"
    monkeypatch.setenv("SPECMIX_CACHE", str(tmp_path / "env"))
    assert recipe.pair_dir("tiny").parent == tmp_path / "env"
    assert recipe.pair_dir("tiny", tmp_path / "arg").parent == tmp_path / "arg"
    name = recipe.pair_dir("tiny").name
    assert name.startswith(f"demo-tiny-v{recipe.RECIPE_VERSION}-") and name != recipe.pair_dir("demo").name
    monkeypatch.setattr(recipe, "RECIPE_VERSION", recipe.RECIPE_VERSION + 1)
    assert recipe.pair_dir("tiny").name != name  # a new recipe version is a new directory


def test_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="size='huge'.*demo, tiny"):
        pair.demo_pair("huge", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- the built pair


def test_pair_layout_and_report(tiny_pair: tuple[Path, Path]) -> None:
    target, draft = tiny_pair
    root = target.parent
    assert draft.parent == root and root.name.startswith("demo-tiny-")
    t = recipe.demo_texts()
    assert (root / "heldout.txt").read_text(encoding="utf-8") == t["heldout"]
    assert (root / "calib.txt").read_text(encoding="utf-8") == t["calib"]
    rep = pair.demo_report("tiny", root.parent)
    assert rep == json.loads((root / "report.json").read_text(encoding="utf-8"))
    assert rep["agreement"] >= 0.5
    assert rep["eval_positions"] > 1000
    for name, d in (("target", target), ("draft", draft)):
        m = rep[name]
        assert m["params"] == sum(p.numel() for p in load_model(d).parameters())
        assert 1.0 < m["heldout_ppl"] < rep["vocab_size"] and m["train_s"] > 0
    assert rep["draft"]["params"] * 10 <= rep["target"]["params"]
    # the draft is the train-draft tool's, trained with the recipe's options on the target's generations
    tool = json.loads((draft / "train_report.json").read_text(encoding="utf-8"))
    options = json.loads(json.dumps(asdict(recipe.get_recipe("tiny").draft)))  # as the report's JSON holds them
    assert tool["kind"] == "model" and tool["options"] == options
    assert rep["draft"]["steps"] == tool["steps"] and rep["draft"]["generated_tokens"] == tool["generated_tokens"] > 0
    assert rep["target"]["heldout_ppl"] < rep["draft"]["heldout_ppl"]
    # its greedy rounds at K = 5 simulated on held-out continuations (the tool's; tests/test_distill_eval.py
    # checks them against the engine's rounds)
    rounds = rep["draft"]["greedy_rounds_k5"]
    assert rounds == tool["heldout"] and rounds["k"] == 5 and rounds["sequences"] == 8
    assert 0.2 < rounds["acceptance"] <= 1 and rounds["rounds"] > 8
    # the tokenizer (and so the models) saw the training split only
    assert rep["train_tokens"] == len(Tokenizer(target).encode(t["train"]))


def test_checkpoint_files(tiny_pair: tuple[Path, Path]) -> None:
    from safetensors import safe_open

    for d in tiny_pair:
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
        eos = Tokenizer(d).token_to_id("<|endoftext|>")
        assert cfg["eos_token_id"] == eos == cfg["bos_token_id"]
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == eos
        assert cfg["torch_dtype"] == "float32" and cfg["max_position_embeddings"] >= 256
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
            assert all(k.startswith("model.") for k in keys) and "model.embed_tokens.weight" in keys
            assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    target, draft = tiny_pair
    assert _digest(target / "tokenizer.json") == _digest(draft / "tokenizer.json")


def test_tokenizer_round_trips(tiny_pair: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    target, _ = tiny_pair
    ours = Tokenizer(target)
    hf = AutoTokenizer.from_pretrained(str(target))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(target / "tokenizer.json"))
    samples = [
        recipe.demo_texts()["heldout"][:3000],
        "  leading spaces\n\n\ttabs and ünïcödé — “quotes” 🐍\n",
        "def f(x):\n    return x ** 2  # comment\n",
    ]
    for s in samples:
        ids = ours.encode(s)
        assert ours.decode(ids) == s
        assert hf.encode(s, add_special_tokens=False) == ids == fast.encode(s, add_special_tokens=False)
        assert hf.decode(ids) == s
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == ours.token_to_id("<|endoftext|>")
    assert ours.vocab_size == recipe.get_recipe("tiny").vocab_size


@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_logits_match_transformers(tiny_pair: tuple[Path, Path], which: int) -> None:
    from transformers import LlamaForCausalLM

    d = tiny_pair[which]
    ours = load_model(d, dtype=torch.float32)
    theirs = LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    text = recipe.demo_texts()["heldout"][:4000]
    ids = torch.tensor([Tokenizer(d).encode(text)[:200]])
    with torch.no_grad():
        a, b = ours(ids), theirs(ids).logits
    assert a.shape == b.shape == (1, 200, ours.config.vocab_size)
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-4
    # trained, not random: the held-out text is far more likely than uniform
    nll = torch.nn.functional.cross_entropy(a[0, :-1], ids[0, 1:]).item()
    assert nll < math.log(ours.config.vocab_size) - 1.0


def test_draft_agrees_with_target(tiny_pair: tuple[Path, Path]) -> None:
    """Recompute the reported agreement from the saved checkpoints."""
    target, draft = tiny_pair
    ids = torch.tensor(Tokenizer(target).encode((target.parent / "heldout.txt").read_text(encoding="utf-8")))
    ev = demo_evaluate.evaluate_pair(load_model(target), load_model(draft), ids, recipe.get_recipe("tiny").eval_ctx)
    rep = json.loads((target.parent / "report.json").read_text())
    assert ev["agreement"] == pytest.approx(rep["agreement"], abs=2e-3)
    assert ev["target_ppl"] == pytest.approx(rep["target"]["heldout_ppl"], rel=1e-3)


# ----------------------------------------------------------------------------- cache and atomicity


def test_second_call_is_a_cache_hit(
    tiny_pair: tuple[Path, Path], tiny_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = _digest(tiny_pair[0] / "model.safetensors")

    def no_build(*a: object, **k: object) -> None:
        raise AssertionError("rebuilt a cached pair")

    monkeypatch.setattr(pair, "build_pair", no_build)
    t0 = time.perf_counter()
    assert pair.demo_pair("tiny", cache_dir=tiny_cache, progress=False) == tiny_pair
    assert time.perf_counter() - t0 < 1.0
    assert _digest(tiny_pair[0] / "model.safetensors") == before


def _fake_build(recipe: recipe.DemoRecipe, out: Path, progress: bool = True, size: str = "") -> dict:
    for name in ("target", "draft"):
        (out / name).mkdir()
    (out / "report.json").write_text("{}")
    return {}


def test_killed_build_leaves_no_pair_and_is_cleaned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a build that is killed (SIGKILL) half-way through writing its files
    code = (
        "import sys, time, pathlib\n"
        "import engine.demo.pair as d\n"
        "def build(recipe, out, progress=True, size=''):\n"
        "    (out / 'target').mkdir(); (out / 'target' / 'config.json').write_text('{}')\n"
        "    pathlib.Path(sys.argv[2]).write_text('started'); time.sleep(120)\n"
        "d.build_pair = build\n"
        "d.demo_pair('tiny', cache_dir=sys.argv[1], progress=False)\n"
    )
    flag = tmp_path / "started"
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", code, str(cache), str(flag)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the builder did not start"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    final = recipe.pair_dir("tiny", cache)
    assert not final.exists()  # no half pair under the final name
    stale = list(cache.glob(f".{final.name}.tmp-*"))
    assert len(stale) == 1 and (stale[0] / "target" / "config.json").is_file()
    # the next call ignores the killed build's files, cleans them and builds (here: a fake builder)
    monkeypatch.setattr(pair, "build_pair", _fake_build)
    target, draft = pair.demo_pair("tiny", cache_dir=cache, progress=False)
    assert target == final / "target" and target.is_dir() and draft.is_dir()
    assert not (target / "config.json").exists()
    assert not list(cache.glob(f".{final.name}.tmp-*"))


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(recipe: recipe.DemoRecipe, out: Path, progress: bool = True, size: str = "") -> dict:
        (out / "target").mkdir()
        raise RuntimeError("boom")

    monkeypatch.setattr(pair, "build_pair", failing)
    with pytest.raises(RuntimeError, match="boom"):
        pair.demo_pair("tiny", cache_dir=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


# ----------------------------------------------------------------------------- the tool


def test_tool_prints_the_report(tiny_pair: tuple[Path, Path], tiny_cache: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "make_demo_models.py"),
            "--size",
            "tiny",
            "--cache-dir",
            str(tiny_cache),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rep = pair.demo_report("tiny", tiny_cache)
    assert f"{rep['agreement']:.3f}" in r.stdout
    assert f"{rep['target']['heldout_ppl']:.2f}" in r.stdout and f"{rep['draft']['heldout_ppl']:.2f}" in r.stdout
    assert str(tiny_pair[0]) in r.stdout


@pytest.mark.parametrize("args", [["--size", "huge"], ["--cache-dir", "__FILE__"]])
def test_tool_errors_are_one_line(tmp_path: Path, args: list[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    args = [str(blocker) if a == "__FILE__" else a for a in args]
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_demo_models.py"), "--quiet", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
    assert ("huge" in r.stderr) if "huge" in args else (str(blocker) in r.stderr)

"""Checks on the full demo pair, run when the specmix cache holds it (``slow``), and on how the cache
directory of a pair is built, replaced and recovered (fast: a stand-in build copies the test pair).

CI does not build the pair (about 9 minutes on 2 AVX2 cores, beside a 12-minute suite), so these
tests skip, saying so, on a machine that has not built it: `python tools/make_demo_models.py`
(or the README's main job) builds it once. The same code paths run on the tiny pair in
tests/test_demo.py, tests/test_profile.py and the speculation tests.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.build.calibrate import acceptance, calib_prompts
from engine.build.quality import compare_models, load_eval_ids
from engine.core.config import load_config
from engine.core.files import sha256_file
from engine.demo.pair import demo_pair
from engine.demo.recipe import pair_dir
from quant.catalog import lookup_gpu
from quant.plan import make_plan


@pytest.fixture(scope="module")
def demo():
    if not (pair_dir("demo") / "report.json").is_file():
        pytest.skip(f"the full demo pair is not built in {pair_dir('demo').parent} (python tools/make_demo_models.py)")
    target, draft = demo_pair("demo", progress=False)
    root = target.parent
    return {
        "target": target,
        "draft": draft,
        "heldout": (root / "heldout.txt").read_text(encoding="utf-8"),
        "calib": (root / "calib.txt").read_text(encoding="utf-8"),
    }


@pytest.fixture(scope="module")
def plan(demo):
    return make_plan(lookup_gpu("a100"), load_config(demo["target"]), load_config(demo["draft"]), device="cpu")


@pytest.mark.slow
def test_greedy_speculation_equals_plain_on_the_demo_pair(demo):
    plain = Engine.from_pretrained(demo["target"])
    prompts = calib_prompts(plain.tokenizer, demo["heldout"], n=6, prompt_len=24)
    sp = SamplingParams(max_new_tokens=40)
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    for drafter, k in [("model", 2), ("model", 5), ("ngram", 4), ("early-exit", 3)]:
        eng = Engine.from_pretrained(
            demo["target"],
            demo["draft"] if drafter == "model" else None,
            speculation=SpeculationConfig(drafter=drafter, k=k, k_policy="constant"),
        )
        one = [eng.generate([p], sp)[0].token_ids for p in prompts]
        batched = [o.token_ids for o in eng.generate(prompts, sp)]
        assert one == ref and batched == ref, (drafter, k)
        if drafter == "model":
            assert eng.stats()["acceptance_rate"] > 0.3  # a broken cache or position gives ~0.05


@pytest.mark.slow
def test_planned_target_is_close_to_its_unquantized_self(demo, plan):
    ref = Engine.from_pretrained(demo["target"])
    planned = Engine.from_pretrained(
        demo["target"], precision=PrecisionConfig(dataclasses.replace(plan, draft=None), demo["calib"])
    )
    assert type(planned.target.layers[0].mlp.down_proj).__name__ == "Int8Linear"
    ids = load_eval_ids(ref.tokenizer, demo["heldout"], max_tokens=4096)
    rep = compare_models(ref.logits, planned.logits, ids, 512)
    assert rep.kld_mean <= 0.01 and rep.top1 >= 0.97, rep.to_dict()
    assert abs(rep.drift) <= 0.3


@pytest.mark.slow
def test_fp8_draft_accepts_within_two_points_of_the_fp16_draft(demo, plan):
    spec = SpeculationConfig(k=4, k_policy="constant")
    fp8 = Engine.from_pretrained(
        demo["target"], demo["draft"], speculation=spec, precision=PrecisionConfig(plan, demo["calib"])
    )
    fp16_plan = dataclasses.replace(plan, draft=None)
    fp16 = Engine.from_pretrained(
        demo["target"], demo["draft"], speculation=spec, precision=PrecisionConfig(fp16_plan, demo["calib"])
    )
    assert type(fp8.draft_model.layers[0].mlp.up_proj).__name__ == "FP8Linear"
    # 24 prompts (~1000 drafts; the difference's standard error ~1 point): with 8, the v3 pair's
    # difference read 3.3 points on one set and 1.3 on 24
    prompts = calib_prompts(fp8.tokenizer, demo["calib"], n=24)
    a8, a16 = acceptance(fp8, prompts, 48), acceptance(fp16, prompts, 48)
    assert abs(a8 - a16) <= 0.02, (a8, a16)


class StandIn:
    """A stand-in for the pair's build (``engine.demo.pair.build_pair``): the test pair copied in, then
    report.json (the build's last file) naming the build's number; counts its calls."""

    def __init__(self, target: Path, draft: Path) -> None:
        self.target, self.draft, self.calls = target, draft, 0

    def __call__(self, recipe, out: Path, progress: bool = True, size: str = "custom") -> dict:
        self.calls += 1
        shutil.copytree(self.target, out / "target")
        shutil.copytree(self.draft, out / "draft")
        report = {"size": size, "build": self.calls}
        (out / "report.json").write_text(json.dumps(report), encoding="utf-8")
        return report


@pytest.fixture
def stand_in(monkeypatch, ckpt_dir, draft_dir) -> StandIn:
    build = StandIn(ckpt_dir, draft_dir)
    monkeypatch.setattr("engine.demo.pair.build_pair", build)
    return build


def _files(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): sha256_file(p) for p in sorted(d.rglob("*")) if p.is_file()}


def _greedy(target: Path, draft: Path) -> list[list[int]]:
    eng = Engine.from_pretrained(target, draft, speculation=SpeculationConfig(k=3, k_policy="constant"))
    return [o.token_ids for o in eng.generate(["The quick brown fox", "def f(x):"], SamplingParams(max_new_tokens=12))]


def _leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_forced_rebuild_that_fails_keeps_the_old_pair(stand_in, monkeypatch, tmp_path):
    """force=True builds beside the old pair: a failure in the training (the real build, its target's training
    step made to raise) leaves the old pair's files as they were and usable; a later call builds nothing."""
    import engine.demo.pair as pair_module
    from engine.demo.train import build_pair as real_build

    target, draft = demo_pair("tiny", tmp_path, progress=False)
    before, ref = _files(target.parent), _greedy(target, draft)

    def fail(*args, **kw):
        raise RuntimeError("injected: the training step failed")

    monkeypatch.setattr(pair_module, "build_pair", real_build)
    monkeypatch.setattr("engine.demo.train._train_target", fail)
    with pytest.raises(RuntimeError, match="injected"):
        demo_pair("tiny", tmp_path, progress=False, force=True)
    assert _files(target.parent) == before and _leftovers(tmp_path) == []
    monkeypatch.setattr(pair_module, "build_pair", stand_in)
    assert demo_pair("tiny", tmp_path, progress=False) == (target, draft) and stand_in.calls == 1
    assert _greedy(target, draft) == ref


def test_forced_rebuild_replaces_the_pair_once_complete(stand_in, tmp_path):
    target, _ = demo_pair("tiny", tmp_path, progress=False)
    assert demo_pair("tiny", tmp_path, progress=False, force=True)[0] == target
    assert json.loads((target.parent / "report.json").read_text())["build"] == 2
    assert _leftovers(tmp_path) == []


def test_stale_pair_directory_and_staging_leftovers_are_rebuilt_once(stand_in, tmp_path):
    """A pair directory without report.json (an older or killed build) and a half-written staging directory
    are removed, the pair is built once, and later calls find it."""
    final = pair_dir("tiny", tmp_path)
    (final / "target").mkdir(parents=True)
    (final / "target" / "config.json").write_text("{}", encoding="utf-8")
    staging = final.parent / f".{final.name}.tmp-999999"
    (staging / "draft").mkdir(parents=True)
    for _ in range(2):
        target, draft = demo_pair("tiny", tmp_path, progress=False)
        assert target == final / "target" and (final / "report.json").is_file()
    assert stand_in.calls == 1 and _leftovers(tmp_path) == []
    assert _files(target) == _files(stand_in.target)
    assert _greedy(target, draft) == _greedy(stand_in.target, stand_in.draft)


def test_pair_moved_aside_by_an_interrupted_swap_is_restored(stand_in, tmp_path):
    """A rebuild killed between moving the old pair aside and renaming the new one in: the next call puts the
    complete old pair back instead of training again."""
    target, _ = demo_pair("tiny", tmp_path, progress=False)
    final = target.parent
    aside = final.parent / f".{final.name}.old-999999"
    final.rename(aside)
    assert demo_pair("tiny", tmp_path, progress=False)[0] == target
    assert stand_in.calls == 1 and (final / "report.json").is_file() and _leftovers(tmp_path) == []

"""The embedded demo pair: a target and a distilled draft trained on CPython's docs.

``demo_pair(size)`` returns ``(target_dir, draft_dir)``, building them on the CPU when the
cache lacks them (engine/demo/recipe.py names the directory, engine/demo/train.py trains).
A build happens in a temporary directory beside the target and is renamed into place at
the end under a lock: a killed build leaves no pair.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from engine.core.files import file_lock
from engine.demo.recipe import DemoRecipe, get_recipe, pair_dir
from engine.demo.train import build_pair as _train

log = logging.getLogger(__name__)


def demo_pair(
    size: str = "demo", cache_dir: str | Path | None = None, progress: bool = True, force: bool = False
) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the demo pair of ``size``, built first when the cache lacks it."""
    final = pair_dir(size, cache_dir)
    if force or not (final / "report.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(final.parent / f".{final.name}.lock"):
            if force and final.exists():
                shutil.rmtree(final)
            if not (final / "report.json").is_file():
                _build_atomic(size, final, progress)
    return final / "target", final / "draft"


def demo_report(size: str = "demo", cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The build report of a pair (builds it when missing)."""
    target, _ = demo_pair(size, cache_dir, progress=False)
    return json.loads((target.parent / "report.json").read_text(encoding="utf-8"))


def _build_atomic(size: str, final: Path, progress: bool) -> None:
    # we hold the lock: any temp dir left beside the target is from a killed build
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        log.warning("removing %s (left by an interrupted build)", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        build_pair(get_recipe(size), tmp, progress=progress, size=size)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def build_pair(recipe: DemoRecipe, out: Path, progress: bool = True, size: str = "custom") -> dict[str, Any]:
    """Train tokenizer, target and draft into ``out`` (target/, draft/, *.txt, report.json)."""
    return _train(recipe, out, progress, size)

"""The embedded demo pair: a target and a distilled draft trained on CPython's docs.

``demo_pair(size)`` returns ``(target_dir, draft_dir)``, building them on the CPU when the
cache lacks them (engine/demo/recipe.py names the directory, engine/demo/train.py trains).
A build happens under a lock in a staging directory beside the pair's and is renamed into
place once complete (engine/core/files.py's ``cached_dir``): a killed or failing build
leaves no pair and keeps an older one (``force=True``) as it was; a leftover pair directory
without its report.json is removed and built again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.core.files import cached_dir
from engine.demo.recipe import DemoRecipe, get_recipe, pair_dir
from engine.demo.train import build_pair as _train


def demo_pair(
    size: str = "demo", cache_dir: str | Path | None = None, progress: bool = True, force: bool = False
) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the demo pair of ``size``, built first when the cache lacks it (``force``:
    rebuilt; the old pair stays in place until the new one is complete)."""
    recipe = get_recipe(size)
    final = cached_dir(pair_dir(size, cache_dir), lambda tmp: build_pair(recipe, tmp, progress, size), _complete, force)
    return final / "target", final / "draft"


def demo_report(size: str = "demo", cache_dir: str | Path | None = None) -> dict[str, Any]:
    """The build report of a pair (builds it when missing)."""
    target, _ = demo_pair(size, cache_dir, progress=False)
    return json.loads((target.parent / "report.json").read_text(encoding="utf-8"))


def _complete(d: Path) -> bool:
    """A pair directory is complete once its build wrote report.json (the last file it writes)."""
    return (d / "report.json").is_file()


def build_pair(recipe: DemoRecipe, out: Path, progress: bool = True, size: str = "custom") -> dict[str, Any]:
    """Train tokenizer, target and draft into ``out`` (target/, draft/, *.txt, report.json)."""
    return _train(recipe, out, progress, size)

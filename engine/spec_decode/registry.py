"""The one registry of drafters: each name, its factory, the config fields it reads and what it loads.

Options validation (engine/api/options.py), assembling an engine (engine/api/assemble.py), the tools' choices
(serve, bench, train-draft), calibration (engine/build/calibrate.py), draft training (engine/train/) and the
README's drafter table all read it. Adding a drafter is one module under engine/spec_decode/drafters/ and
one ``DrafterEntry``; a program (or a test) adds its own with ``DRAFTERS.extended(entry)`` and passes the
registry in ``SpeculationConfig.registry``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.core.errors import InvalidConfigError
from engine.spec_decode.drafter import Drafter, DrafterContext
from engine.spec_decode.drafters.draft_model import ModelDrafter
from engine.spec_decode.drafters.eagle import EagleDrafter
from engine.spec_decode.drafters.eagle3 import Eagle3Drafter
from engine.spec_decode.drafters.early_exit import EarlyExitDrafter
from engine.spec_decode.drafters.lookup import LookupFirst
from engine.spec_decode.drafters.medusa import MedusaDrafter
from engine.spec_decode.drafters.ngram import NGramDrafter
from engine.spec_decode.drafters.suffix import SuffixDrafter


class Loads(enum.Enum):
    """What a drafter's ``draft`` argument (``Engine.from_pretrained(target, draft)``) holds."""

    NOTHING = "nothing"  # no draft argument
    DRAFT_MODEL = "a draft checkpoint"  # a Hugging Face checkpoint of the target's vocabulary
    HEAD = "a trained head directory"  # written by specmix-train-draft (engine/spec_decode/heads/)


@dataclass(frozen=True)
class DrafterEntry:
    """One drafter of the registry."""

    name: str
    """The name ``SpeculationConfig.drafter`` takes."""
    summary: str
    """One line for the README's table and the tools' help."""
    build: Callable[[DrafterContext], Drafter]
    """The factory: the drafter for an engine's models."""
    loads: Loads = Loads.NOTHING
    """What the ``draft`` argument holds for it."""
    fields: tuple[str, ...] = ()
    """``SpeculationConfig`` fields only this drafter reads (refused with another); its factory gets them."""
    trainable: bool = False
    """``specmix-train-draft --kind NAME`` trains a draft for it (a head's kind is its name)."""
    lookup_first: bool = True
    """Prompt lookup first may wrap it (``SpeculationConfig.prompt_lookup_min``)."""
    trees: bool = False
    """It drafts trees where ``tree_branches`` > 1 (the model and the heads: EAGLE-2's for greedy batches, spine trees
    for sampled ones); the measured K policy then chooses per batch between its trees and chains."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InvalidConfigError(f"DrafterEntry.name={self.name!r} is invalid: allowed a non-empty str")


@dataclass(frozen=True)
class DrafterRegistry:
    """Drafter entries by name (immutable: ``extended`` returns a new registry)."""

    entries: tuple[DrafterEntry, ...]

    def __post_init__(self) -> None:
        names = [e.name for e in self.entries]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InvalidConfigError(f"drafter registry: name(s) {', '.join(dup)} registered twice")

    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def __contains__(self, name: object) -> bool:
        return any(e.name == name for e in self.entries)

    def __iter__(self) -> Iterator[DrafterEntry]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> DrafterEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise InvalidConfigError(f"speculation.drafter={name!r} is invalid: allowed {', '.join(self.names())} or None")

    def extended(self, *entries: DrafterEntry) -> DrafterRegistry:
        """This registry with ``entries`` added (a name already here is refused)."""
        return DrafterRegistry(self.entries + tuple(entries))

    def trainable(self) -> tuple[str, ...]:
        """The kinds specmix-train-draft trains."""
        return tuple(e.name for e in self.entries if e.trainable)

    def loading(self, what: Loads) -> tuple[str, ...]:
        """The drafters whose ``draft`` argument holds ``what``."""
        return tuple(e.name for e in self.entries if e.loads is what)


def build_drafter(entry: DrafterEntry, ctx: DrafterContext, prompt_lookup_min: int | None) -> Drafter:
    """The entry's drafter, wrapped by prompt lookup first when ``prompt_lookup_min`` is set."""
    drafter = entry.build(ctx)
    if not isinstance(drafter, Drafter):  # every member present: a drafter registered elsewhere is checked at load
        raise InvalidConfigError(
            f"drafter {entry.name!r} ({type(drafter).__name__}) does not implement engine/spec_decode/drafter.py's "
            "Drafter: allowed an object with its attributes (features, max_drafts, samples) and methods"
        )
    if prompt_lookup_min is None:
        return drafter
    if not entry.lookup_first:
        raise InvalidConfigError(
            f"speculation.prompt_lookup_min={prompt_lookup_min} is invalid with drafter {entry.name!r}"
        )
    return LookupFirst(drafter, prompt_lookup_min)


DRAFTERS = DrafterRegistry(
    (
        DrafterEntry(
            "model",
            "a small draft model of the target's vocabulary, with its own KV cache",
            ModelDrafter.build,
            loads=Loads.DRAFT_MODEL,
            trainable=True,
            trees=True,
        ),
        DrafterEntry(
            "ngram",
            "prompt lookup: copies what followed the context's latest match of its last tokens (with "
            "tree_branches > 1, a tree of the continuations of several matches); no model",
            NGramDrafter.build,
            lookup_first=False,
            trees=True,
        ),
        DrafterEntry(
            "early-exit",
            "the target's first layers with its final norm and LM head, in the target's cache",
            EarlyExitDrafter.build,
            fields=("early_exit_layers",),
        ),
        DrafterEntry(
            "medusa",
            "Medusa heads on the target's feature: one draft per head, all at once (tree_branches > 1: a tree "
            "of each head's top tokens, or of its draws when sampled)",
            MedusaDrafter.build,
            loads=Loads.HEAD,
            trainable=True,
            trees=True,
        ),
        DrafterEntry(
            "eagle",
            "an EAGLE-style head on the target's features (MLP blocks, or decoder layers with attention)",
            EagleDrafter.build,
            loads=Loads.HEAD,
            trainable=True,
            trees=True,
        ),
        DrafterEntry(
            "eagle3",
            "an EAGLE-3 head: the target's hidden states at three layers fused, one decoder layer, a reduced "
            "vocabulary (trained here, or an EAGLE authors' / SpecForge / speculators checkpoint)",
            Eagle3Drafter.build,
            loads=Loads.HEAD,
            trainable=True,
            trees=True,
        ),
        DrafterEntry(
            "suffix",
            "suffix decoding: frequency-scored continuations of the context's longest suffix match in suffix trees "
            "of the request and of recent outputs (tree_branches > 1: trees, else chains); no model; needs the "
            "suffix extra",
            SuffixDrafter.build,
            fields=("suffix_global_tokens",),
            lookup_first=False,
            trees=True,
        ),
    )
)

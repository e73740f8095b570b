"""Fault isolation: a step that raised changed no sequence (engine/spec_decode/loop.py), so it is re-run in parts,
and only the parts that fail alone fail; the scheduler ends their requests and keeps serving."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.spec_decode.k_caps import KCaps
from engine.spec_decode.loop import DecodeLoop
from engine.spec_decode.seq import Seq


@dataclass
class Rerun:
    """What the parts of a failed step did."""

    events: list[tuple[Seq, list[int]]] = field(default_factory=list)
    """Each sequence of the parts that ran, with its new tokens."""
    ran: int = 0
    """Parts that ran."""
    failed: list[tuple[list[Seq], Exception]] = field(default_factory=list)
    """The parts that failed alone, each with its error."""


def by_family(loop: DecodeLoop, seqs: list[Seq], caps: KCaps, e: Exception) -> Rerun:
    """A round over ``seqs`` raised ``e``: re-run it one prefill family at a time (a sequence with those waiting for
    its prefill)."""
    families: dict[int, list[Seq]] = {}
    for s in seqs:
        families.setdefault(id(s.prefill_from or s), []).append(s)
    return _in_parts(list(families.values()), lambda fam: loop.step(fam, caps), e)


def by_sequence(loop: DecodeLoop, chunks: list[tuple[Seq, int]], e: Exception) -> Rerun:
    """Prefill chunks that raised ``e`` (``DecodeLoop.prefill``): re-run one sequence at a time."""
    size = {id(s): n for s, n in chunks}

    def run(part: list[Seq]) -> list[tuple[Seq, list[int]]]:
        loop.prefill([(part[0], size[id(part[0])])])
        return []  # (a chunk hands out no tokens)

    return _in_parts([[s] for s, _ in chunks], run, e)


def _in_parts(parts: list[list[Seq]], run: Callable[[list[Seq]], list[tuple[Seq, list[int]]]], e: Exception) -> Rerun:
    """Each part run alone; a single part fails with ``e``, not run again."""
    if len(parts) == 1:
        return Rerun(failed=[(parts[0], e)])
    out = Rerun()
    for part in parts:
        try:
            out.events += run(part)
            out.ran += 1
        except Exception as e2:  # noqa: BLE001 - this part fails alone
            out.failed.append((part, e2))
    return out

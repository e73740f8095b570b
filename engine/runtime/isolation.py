"""Fault isolation: a step that raised changed no sequence (engine/spec_decode/loop.py), so it is re-run in parts,
and only the parts that fail alone fail; the scheduler ends their requests and keeps serving."""

from __future__ import annotations

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
    its prefill). A single family fails with ``e``, not run again."""
    families: dict[int, list[Seq]] = {}
    for s in seqs:
        families.setdefault(id(s.prefill_from or s), []).append(s)
    if len(families) == 1:
        return Rerun(failed=[(seqs, e)])
    out = Rerun()
    for fam in families.values():
        try:
            out.events += loop.step(fam, caps)
            out.ran += 1
        except Exception as e2:  # noqa: BLE001 - this family fails alone
            out.failed.append((fam, e2))
    return out


def by_sequence(loop: DecodeLoop, chunks: list[tuple[Seq, int]], e: Exception) -> Rerun:
    """Prefill chunks that raised ``e`` (``DecodeLoop.prefill``): re-run one sequence at a time. A single chunk fails
    with ``e``, not run again."""
    if len(chunks) == 1:
        return Rerun(failed=[([chunks[0][0]], e)])
    out = Rerun()
    for c in chunks:
        try:
            loop.prefill([c])
            out.ran += 1
        except Exception as e2:  # noqa: BLE001 - this sequence fails alone
            out.failed.append(([c[0]], e2))
    return out

"""tools/bench.py --workload FILE: chat prompts by category (tools/make_workload.py writes them), rendered with
the target's chat template, each category run as its own prompt list inside every mode's run, and the
per-category rows (tokens/s, speedup vs plain, acceptance, mean accepted length, per-position acceptance).

A line of the file: ``{"category": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``,
the last message the user's (the model answers it)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import Engine
from engine.build.plots import aggregate_positions
from engine.cli.bench_modes import spec_runner
from engine.core.chat import ChatTemplate
from engine.core.errors import InvalidConfigError

ROLES = ("system", "user", "assistant")
KEYS = ("category", "messages")
Runner = Callable[[], tuple[int, float]]


@dataclass(frozen=True)
class WorkloadItem:
    """One prompt of a workload: its category and its chat messages."""

    category: str
    messages: list[dict[str, str]]


def _check_line(obj: Any, where: str) -> WorkloadItem:
    if not isinstance(obj, dict):
        raise InvalidConfigError(f"{where} is invalid: allowed a JSON object with keys {', '.join(KEYS)}")
    extra = sorted(set(obj) - set(KEYS))
    if extra:
        raise InvalidConfigError(f"{where}: unknown field {extra[0]!r}: allowed {', '.join(KEYS)}")
    cat = obj.get("category")
    if not isinstance(cat, str) or not cat.strip():
        raise InvalidConfigError(f"{where}: category={cat!r:.60} is invalid: allowed a non-empty string")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidConfigError(f"{where}: messages={msgs!r:.60} is invalid: allowed a non-empty list of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise InvalidConfigError(
                f"{where}: messages[{i}]={m!r:.60} is invalid: allowed an object with exactly role and content"
            )
        if m["role"] not in ROLES:
            raise InvalidConfigError(
                f"{where}: messages[{i}].role={m['role']!r:.40} is invalid: allowed {', '.join(map(repr, ROLES))}"
            )
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise InvalidConfigError(
                f"{where}: messages[{i}].content={m['content']!r:.40} is invalid: allowed a non-empty string"
            )
    if msgs[-1]["role"] != "user":
        raise InvalidConfigError(
            f"{where}: messages[{len(msgs) - 1}].role={msgs[-1]['role']!r} is invalid: the last message is the "
            "user's (the model answers it)"
        )
    return WorkloadItem(cat, [dict(m) for m in msgs])


def load_workload(path: Path) -> list[WorkloadItem]:
    """Every prompt of a workload file, each line checked (blank lines skipped); InvalidConfigError naming the
    line and the field otherwise."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidConfigError(f"--workload {path}: unreadable ({e})") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--workload {path}: line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidConfigError(f"{where} is not JSON ({e.msg} at column {e.colno})") from None
        items.append(_check_line(obj, where))
    if not items:
        raise InvalidConfigError(f"--workload {path}: no prompts in the file")
    return items


def check_template(target: Path) -> None:
    """Refuse a target without a chat template before any engine is built."""
    if ChatTemplate.from_dir(target) is None:
        raise InvalidConfigError(
            f"--workload needs a target with a chat template: {target} has none (no chat_template in "
            "tokenizer_config.json, no chat_template.jinja); use --prompts for plain text prompts"
        )


@dataclass
class Split:
    """A workload's prompts by category (rendered to token ids, categories in file order) and what the runs of
    each mode leave per category: tokens/s and Completion stats per call, the first call the warm-up."""

    prompts: dict[str, list[list[int]]]
    rates: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    stats: dict[str, dict[str, list[list[dict[str, Any]]]]] = field(default_factory=dict)

    @classmethod
    def render(cls, eng: Engine, items: Sequence[WorkloadItem]) -> Split:
        """Each item's messages as the engine's chat template renders them (with the generation prompt)."""
        prompts: dict[str, list[list[int]]] = {}
        for it in items:
            prompts.setdefault(it.category, []).append(eng.chat_prompt(it.messages))
        return cls(prompts)

    def counts(self) -> dict[str, int]:
        """Prompts per category."""
        return {c: len(ps) for c, ps in self.prompts.items()}

    def flat(self) -> list[list[int]]:
        """Every prompt, category after category (the order of a mode's outputs)."""
        return [p for ps in self.prompts.values() for p in ps]

    def joined(self, mode: str, runners: dict[str, Runner], after: Callable[[str], None] | None = None) -> Runner:
        """One run of every category (``runners``: each category's), recording each one's tokens/s under
        ``mode``; returns the totals as a mode's runner does. ``after(category)`` runs after each category."""
        rates = self.rates.setdefault(mode, {c: [] for c in runners})

        def run() -> tuple[int, float]:
            toks, secs = 0, 0.0
            for c, r in runners.items():
                t, s = r()
                rates[c].append(t / s)
                toks, secs = toks + t, secs + s
                if after is not None:
                    after(c)
            return toks, secs

        return run

    def spec(self, mode: str, eng: Engine, n: int, sink: list | None, outputs: list[list[int]]) -> Runner:
        """A specmix mode's runner over every category: its outputs in ``flat`` order, its stats into ``sink``
        (the mode's, as spec_runner's) and per category."""
        outs: dict[str, list[list[int]]] = {c: [] for c in self.prompts}
        sinks: dict[str, list[dict[str, Any]]] = {c: [] for c in self.prompts}
        calls = self.stats.setdefault(mode, {c: [] for c in self.prompts})

        def after(c: str) -> None:
            calls[c].append(list(sinks[c]))
            if sink is not None:
                sink.extend(sinks[c])
            sinks[c].clear()
            if c == next(reversed(self.prompts)):  # the last category: the mode's outputs of this run
                outputs[:] = [o for cat in self.prompts for o in outs[cat]]

        runners = {c: spec_runner(eng, ps, n, sinks[c], outs[c]) for c, ps in self.prompts.items()}
        return self.joined(mode, runners, after)

    def rows(self, modes: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Per category: its prompt count and one row per mode run (``modes``, in order); medians over the
        measured calls (the warm-up dropped)."""
        out: dict[str, dict[str, Any]] = {}
        for c, ps in self.prompts.items():
            base = statistics.median(self.rates["plain"][c][1:])
            rows = []
            for m in modes:
                reps = self.rates[m][c][1:]
                row = {"name": m, "tokens_per_s": statistics.median(reps), "repeats": reps}
                row["speedup_vs_plain"] = row["tokens_per_s"] / base
                row.update(_acceptance([st for call in self.stats.get(m, {}).get(c, [])[1:] for st in call]))
                rows.append(row)
            out[c] = {"prompts": len(ps), "prompt_tokens": sum(map(len, ps)), "modes": rows}
        return out


def _acceptance(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance over requests' Completion stats (None without drafts: plain decoding, transformers)."""
    drafted = sum(st.get("drafted", 0) for st in stats)
    if not drafted:
        keys = ("acceptance_rate", "token_acceptance", "mean_accepted_length", "per_position_acceptance")
        return dict.fromkeys(keys)
    accepted = sum(st["accepted"] for st in stats)
    passes = sum(st["target_passes"] for st in stats)
    trials = sum(st.get("draft_trials", 0) for st in stats)
    pos = aggregate_positions(stats)
    return {
        "acceptance_rate": accepted / drafted,
        "token_acceptance": accepted / trials if trials else None,
        "mean_accepted_length": 1 + accepted / passes if passes else None,
        "per_position_acceptance": pos["acceptance"],
        "per_position_requests": pos["requests"],
    }


def print_categories(categories: dict[str, dict[str, Any]]) -> None:
    """The per-category table: each category's modes, acceptance at the first draft positions."""
    fmt = lambda x, f: "-" if x is None else format(x, f)
    rows = [("category", "mode", "tok/s", "x plain", "accept", "mean len", "accept by position")]
    for c, cat in categories.items():
        for m in cat["modes"]:
            pos = m.get("per_position_acceptance") or []
            rows.append(
                (
                    f"{c} ({cat['prompts']})",
                    m["name"],
                    fmt(m["tokens_per_s"], ".1f"),
                    fmt(m["speedup_vs_plain"], ".2f"),
                    fmt(m["acceptance_rate"], ".3f"),
                    fmt(m["mean_accepted_length"], ".2f"),
                    " ".join(fmt(p, ".2f") for p in pos[:6]) or "-",
                )
            )
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for r in rows:
        print("  ".join(cell.ljust(x) for cell, x in zip(r, w)).rstrip())

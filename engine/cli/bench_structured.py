"""Structured outputs with and without speculation: JSON-schema chat requests on one target.

    python tools/bench_structured.py --target DIR [--drafters ngram,suffix] [--batch 1,16] [--repeats 3]

Each drafter's engine and a plain one (speculation off) answer the same chat requests (examples/structured: a
product schema of nested objects, arrays and enums; one ask per line), greedy, constrained by the schema; runs
interleave, the first of each mode is a warm-up, and the table gives medians: tokens/s, x plain, the mean accepted
length, the share of output tokens that were forced drafts, the mask time's share of the rounds, and the share of
outputs that parse as JSON and finish (``stop``). Batch 1 runs the asks one after the other; batch B submits B
at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.cli import OneLineParser, run_tool
from engine.core.errors import InvalidConfigError
from engine.core.files import write_text_atomic
from engine.spec_decode.structured.spec import StructuredOutput

log = logging.getLogger(__name__)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "structured"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="bench_structured", description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True, help="a checkpoint directory with a chat template")
    p.add_argument("--drafters", default="ngram", help="comma-separated drafters (registry names, no draft files)")
    p.add_argument("--k", type=int, default=4, help="drafts per round (the start K of an adaptive policy)")
    p.add_argument("--k-policy", default="constant", help="constant (default), measured, cost-model or heuristic")
    p.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per mode (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=220)
    p.add_argument("--schema", type=Path, default=EXAMPLES / "product.schema.json")
    p.add_argument("--asks", type=Path, default=EXAMPLES / "product_asks.txt", help="one user message per line")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    return p.parse_args(argv)


def _inputs(a: argparse.Namespace) -> tuple[StructuredOutput, list[str], list[int]]:
    try:
        schema = json.loads(a.schema.read_text(encoding="utf-8"))
        asks = [ln.strip() for ln in a.asks.read_text(encoding="utf-8").splitlines() if ln.strip()]
        batches = [int(x) for x in a.batch.split(",")]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InvalidConfigError(f"--schema/--asks/--batch: {e}") from None
    if not asks or any(b < 1 for b in batches) or a.repeats < 1 or a.k < 1:
        raise InvalidConfigError("--asks needs a line, --batch sizes >= 1, --repeats and --k >= 1")
    return StructuredOutput.json(schema), asks, batches


def _run(eng: Engine, prompts: list[list[int]], sp: SamplingParams, batch: int) -> tuple[int, float, int]:
    """(tokens, seconds, outputs that parse and stop) over the prompts, ``batch`` at a time."""
    toks, good, t0 = 0, 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        for o in eng.generate(prompts[i : i + batch], sp):
            toks += len(o.token_ids)
            good += o.finish_reason == "stop" and _parses(o.text)
    return toks, time.perf_counter() - t0, good


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _row(name: str, batch: int, rates: list[float], good: int, n: int, st: dict[str, Any]) -> dict[str, Any]:
    s = st["structured"]
    gen = max(1, st["generated_tokens"])
    return {
        "mode": name,
        "batch": batch,
        "tokens_per_s": statistics.median(rates),
        "repeats": rates,
        "mean_accepted_length": st["mean_accepted_length"],
        "forced_share": s["forced_accepted"] / gen,
        "mask_share": s["mask_seconds"] / st["busy_seconds"] if st["busy_seconds"] else None,
        "valid": good / n,
    }


def bench(a: argparse.Namespace) -> list[dict[str, Any]]:
    so, asks, batches = _inputs(a)
    modes: dict[str, Engine] = {"plain": Engine.from_pretrained(a.target, limits=Limits(max_batch=max(batches)))}
    for d in [x for x in a.drafters.split(",") if x]:
        spec = SpeculationConfig(drafter=d, k=a.k, k_policy=a.k_policy)
        modes[d] = Engine.from_pretrained(a.target, speculation=spec, limits=Limits(max_batch=max(batches)))
    prompts = [modes["plain"].chat_prompt([{"role": "user", "content": q}]) for q in asks]
    sp = SamplingParams(max_new_tokens=a.max_tokens, structured=so)
    rows = []
    for batch in batches:
        rates: dict[str, list[float]] = {m: [] for m in modes}
        good: dict[str, int] = dict.fromkeys(modes, 0)
        before = {m: e.stats() for m, e in modes.items()}
        for rep in range(a.repeats + 1):
            for m, eng in modes.items():
                toks, secs, ok = _run(eng, prompts, sp, batch)
                if rep:  # the first run of each mode is the warm-up
                    rates[m].append(toks / secs)
                    good[m] += ok
        for m, eng in modes.items():
            rows.append(_row(m, batch, rates[m], good[m], len(prompts) * a.repeats, _delta(before[m], eng.stats())))
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    for r in rows:
        r["speedup_vs_plain"] = r["tokens_per_s"] / base[r["batch"]]
    return rows


def _delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The stats of the runs between two snapshots (warm-up included: ratios only)."""
    d = {k: b[k] - a[k] for k in ("generated_tokens", "drafted", "accepted")}
    d["busy_seconds"] = b["busy_seconds"] - a["busy_seconds"]
    d["structured"] = {k: b["structured"][k] - a["structured"][k] for k in b["structured"]}
    passes = (b["sequence_rounds"] - a["sequence_rounds"]) or 1
    d["mean_accepted_length"] = 1 + d["accepted"] / passes
    return d


def _print(rows: list[dict[str, Any]]) -> None:
    head = ("batch", "mode", "tok/s", "x plain", "mean len", "forced", "mask", "valid")
    table = [head] + [
        (
            str(r["batch"]), r["mode"], f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_plain']:.2f}",
            f"{r['mean_accepted_length']:.2f}", f"{r['forced_share']:.2f}",
            "-" if r["mask_share"] is None else f"{r['mask_share']:.3f}", f"{r['valid']:.2f}",
        )
        for r in rows
    ]  # fmt: skip
    w = [max(len(x[i]) for x in table) for i in range(len(head))]
    for x in table:
        print("  ".join(c.ljust(n) for c, n in zip(x, w)).rstrip())


def _main(argv: list[str] | None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    a = _args(argv)
    rows = bench(a)
    _print(rows)
    if a.out is not None:
        write_text_atomic(a.out, json.dumps(rows, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("bench_structured", lambda: _main(argv))

#!/usr/bin/env python
"""Tokens/s and memory of a model unquantized (fp32, plain and with the profile's drafter) against its
precision plan (plain and with the drafter), each mode in its own process so its max RSS is its own.

    python tools/bench_int8.py --profile /tmp/smol-a100.json [--max-new-tokens 96] [--rounds 3] [--json FILE]
        [--gguf model-q8_0.gguf]

Greedy, batch 1, the same chat prompts for every mode (the text itself where the model has no chat template).
Each round runs every mode once, one after another (a fresh process each: model load, one warm-up prompt, then
the prompts timed); figures are medians over the rounds and the ratios are within this one run. Resident weight
bytes are ``Engine.stats()["memory"]`` (weights as allocated: the kernels' copies included). Prints one Markdown table.
``--gguf`` adds llama.cpp as a peer mode (engine/cli/gguf_peer.py: the same prompt ids, greedy, through
llama-cpp-python; its weights are the file's bytes).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine.core.cli import run_tool
from engine.core.errors import EngineError

log = logging.getLogger("bench_int8")


class BenchError(EngineError, RuntimeError):
    """A mode's process failed."""


MODES = ("fp32-plain", "fp32-drafter", "plan-plain", "plan-drafter")
PEER = "gguf"  # llama.cpp on --gguf FILE
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "List five facts about the Moon, one per line.",
    "Explain what a hash table is to a beginner programmer.",
    "Write a short story about a robot that learns to paint.",
)


def _engine(profile: str, mode: str) -> Any:
    from engine import Engine
    from engine.api.options import SpeculationConfig
    from engine.api.profile import engine_options, load_profile

    o = engine_options(load_profile(profile))
    drafter = mode.endswith("drafter")
    spec = o["speculation"] if drafter else SpeculationConfig()
    draft = o["draft"] if drafter else None  # a plain mode loads no draft (a draft alone means the model drafter)
    if mode.startswith("plan"):
        precision = o["precision"] if drafter else o["precision"].target_only()
        return Engine.from_pretrained(
            o["target"], draft, speculation=spec, precision=precision, kernels=o["kernels"], device=o["device"]
        )
    return Engine.from_pretrained(o["target"], draft, speculation=spec)


def child(profile: str, mode: str, max_new: int) -> dict[str, Any]:
    """One mode in this process: tokens/s over the prompts, resident weight bytes, max RSS."""
    from engine import SamplingParams

    eng = _engine(profile, mode)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    from engine.core.chat import ChatTemplateMissingError

    try:
        ids = [eng.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    except ChatTemplateMissingError:  # a base model (the demo pair): the prompts as plain text
        ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    eng.generate([ids[0]], params)  # warm-up (kernels built, caches sized)
    n, t0 = 0, time.perf_counter()
    outs = []
    for p in ids:
        o = eng.generate([p], params)[0]
        n += len(o.token_ids)
        outs.append(o.token_ids)
    dt = time.perf_counter() - t0
    mem = eng.stats()["memory"]
    weights = mem["target_weight_bytes"] + mem.get("draft_weight_bytes", 0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": mode, "tok_s": n / dt, "weight_bytes": weights, "max_rss": rss, "tokens": outs}


def peer(profile: str, gguf: Path, max_new: int) -> dict[str, Any]:
    """One round of the llama.cpp peer on the profile's target's prompts."""
    from engine.api.profile import load_profile, resolve_ref
    from engine.cli.gguf_peer import peer_child

    return peer_child(resolve_ref(load_profile(profile).models.target.path), gguf, PROMPTS, max_new)


def run_rounds(
    profile: str, max_new: int, rounds: int, modes: list[str], gguf: Path | None = None
) -> dict[str, list[dict[str, Any]]]:
    res: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rnd in range(rounds):
        for m in modes:
            cmd = [sys.executable, "-m", "engine.cli.bench_int8", "--profile", profile, "--child", m]
            cmd += ["--gguf", str(gguf)] if m == PEER and gguf is not None else []
            r = subprocess.run([*cmd, "--max-new-tokens", str(max_new)], capture_output=True, text=True)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["no output"])[-1]
                raise BenchError(f"mode {m} failed (exit {r.returncode}): {last}")
            res[m].append(json.loads(r.stdout.strip().splitlines()[-1]))
            log.info("round %d %s: %.1f tok/s", rnd, m, res[m][-1]["tok_s"])
    return res


def table(res: dict[str, list[dict[str, Any]]]) -> str:
    med = {
        m: {k: statistics.median(x[k] for x in rs) for k in ("tok_s", "weight_bytes", "max_rss")}
        for m, rs in res.items()
    }
    base = med.get("fp32-plain")
    rows = [
        "| mode | tokens/s | x fp32 plain | weights resident (MiB) | x fp32 | max RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for m, v in med.items():
        sp = f"{v['tok_s'] / base['tok_s']:.2f}" if base else "-"
        wr = f"{v['weight_bytes'] / base['weight_bytes']:.2f}" if base else "-"
        rows.append(
            f"| {m} | {v['tok_s']:.1f} | {sp} | {v['weight_bytes'] / 2**20:.0f} | {wr} | {v['max_rss'] / 2**20:.0f} |"
        )
    same = {m: rs[0]["tokens"] for m, rs in res.items()}
    for a, b in (("fp32-plain", "fp32-drafter"), ("plan-plain", "plan-drafter")):
        if a in same and b in same:
            rows.append(f"\ngreedy output {a} == {b}: {same[a] == same[b]}")
    if PEER in same and "fp32-plain" in same:
        pairs = [(x, y) for p, q in zip(same[PEER], same["fp32-plain"]) for x, y in zip(p, q)]
        agree = sum(x == y for x, y in pairs) / max(len(pairs), 1)
        rows.append(f"\n{PEER} tokens equal to fp32-plain's at the same position: {agree:.2f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a profile (tools/build_profile.py) of the model")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--json", type=Path, help="write every round's figures here")
    ap.add_argument("--gguf", type=Path, help="a GGUF file of the same model: adds llama.cpp as the mode 'gguf'")
    ap.add_argument("--child", choices=(*MODES, PEER), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.child else logging.INFO, format="%(message)s")
    if a.child:
        n = a.max_new_tokens
        one = peer(a.profile, a.gguf, n) if a.child == PEER else child(a.profile, a.child, n)
        sys.stdout.write(json.dumps(one) + "\n")
        return 0
    return run_tool("bench_int8", lambda: _run(a))


def _run(a: argparse.Namespace) -> int:
    modes = a.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise BenchError(f"--modes {bad[0]!r} is invalid: allowed {', '.join(MODES)}")
    if a.gguf is not None:
        if not a.gguf.is_file():
            raise BenchError(f"--gguf {a.gguf}: no such file")
        modes.append(PEER)
    res = run_rounds(a.profile, a.max_new_tokens, a.rounds, modes, a.gguf)
    if a.json:
        a.json.write_text(json.dumps(res))
    sys.stdout.write(table(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

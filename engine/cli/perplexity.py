#!/usr/bin/env python
"""Recompute a profile's quality gate: the regression check to put in CI.

    python tools/perplexity.py --profile profiles/a100-80gb-demo.json
    python tools/perplexity.py --profile P.json --eval-text wiki.test.raw --max-tokens 20000 --json

Runs the profile's planned target and its unquantized (FP16) reference on the same fixed
windows (llama.cpp style: context = the profile's quality.context; stride half the context;
the second half of each window scored, the first window whole) and prints PPL +/- error for
both, dPPL with its 95% interval (per-window differences), mean and p99 KL divergence
(reference -> planned) and top-1 agreement.

Bounds default to the profile's gates (quality.gates); --max-drift / --max-kld override.
Eval text defaults to the profile's own (quality.eval_text).

Exit status: 0 within bounds; 1 when |dPPL| > max-drift or mean KLD > max-kld, or, on the
profile's own eval text (same sha256 and token cap; the window context is always the
profile's), the recorded PPL of either model (reference and planned) is not reproduced
within a relative tolerance of --ppl-rtol (default 1e-3: |PPL - recorded| <= 1e-3 * recorded);
2 on bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from engine import Engine
from engine.api.profile import Profile, engine_options
from engine.core.cli import OneLineParser, run_tool
from engine.core.errors import ProfileError

log = logging.getLogger("perplexity")
DEFAULT_PPL_RTOL = 1e-3
PROG = "perplexity"


def _positive(kind: type, minimum: float, name: str) -> Any:
    def conv(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text!r} is invalid: allowed a number >= {minimum}") from None
        if not (math.isfinite(v) and v >= minimum):
            raise argparse.ArgumentTypeError(f"{name}={text!r} is invalid: allowed a number >= {minimum}")
        return v

    return conv


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="perplexity.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, required=True, help="profile JSON written by tools/build_profile.py")
    p.add_argument("--eval-text", type=Path, help="UTF-8 text to evaluate on (default: the profile's eval text)")
    p.add_argument(
        "--max-drift",
        type=_positive(float, 0.0, "--max-drift"),
        help="bound on |dPPL| (default: the profile's quality.gates.max_drift)",
    )
    p.add_argument(
        "--max-kld",
        type=_positive(float, 0.0, "--max-kld"),
        help="bound on mean KLD (default: the profile's quality.gates.max_kld)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive(int, 2, "--max-tokens"),
        help="evaluate the first N tokens only (default: the profile's quality.max_tokens, else all)",
    )
    p.add_argument(
        "--ppl-rtol",
        type=_positive(float, 0.0, "--ppl-rtol"),
        default=DEFAULT_PPL_RTOL,
        help="relative tolerance for reproducing the recorded PPLs on the profile's own eval text "
        f"(default {DEFAULT_PPL_RTOL:g})",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="device (default: the profile's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def evaluate(a: argparse.Namespace) -> dict[str, Any]:
    """Recompute the figures; the result dict of the JSON output (``exit_code`` included)."""
    from engine.api.profile import load_profile, resolve_eval_text
    from engine.build.quality import (
        compare_models,
        load_eval_ids,
        read_eval_text,
        text_sha256,
    )

    prof = load_profile(a.profile)  # a typed Profile: every field the check reads is there, of its type
    quality = prof.quality
    max_drift = a.max_drift if a.max_drift is not None else quality.gates.max_drift
    max_kld = a.max_kld if a.max_kld is not None else quality.gates.max_kld
    eval_path = a.eval_text if a.eval_text is not None else resolve_eval_text(prof)
    text = read_eval_text(eval_path)
    sha = text_sha256(text)
    recorded_max, ctx_rec = quality.max_tokens, quality.figures.context
    for key, v in (("max_tokens", recorded_max), ("context", ctx_rec)):
        if v is not None and v < 2:
            raise ProfileError(f"{prof.where}: field quality.{key}={v!r} is invalid: allowed an int >= 2 or null")
    max_tokens = a.max_tokens if a.max_tokens is not None else recorded_max
    same_text = sha == quality.eval_text_sha256
    comparable = same_text and max_tokens == recorded_max
    recorded = {"ppl_ref": quality.figures.ppl_ref, "ppl": quality.figures.ppl} if comparable else None
    planned, reference = engines_for_profile(prof, a.device)
    context = ctx_rec
    ids = load_eval_ids(reference.tokenizer, text, max_tokens=max_tokens)
    rep = compare_models(reference.logits, planned.logits, ids, context, progress=not a.quiet)
    reproduced: bool | None = None
    if recorded is not None:
        got = {"ppl_ref": rep.ppl_ref, "ppl": rep.ppl}
        reproduced = all(abs(got[k] - v) <= a.ppl_rtol * abs(v) for k, v in recorded.items())
    checks = {
        "drift": bool(abs(rep.drift) <= max_drift),
        "kld": bool(rep.kld_mean <= max_kld),
        "reproduced": reproduced,
    }
    ok = checks["drift"] and checks["kld"] and reproduced is not False
    return {
        "profile": str(a.profile),
        "eval_text": str(eval_path),
        "eval_text_sha256": sha,
        "same_eval_text": same_text,
        "max_tokens": max_tokens,
        "device": str(reference.device),
        "quality": rep.to_dict(),
        "bounds": {"max_drift": max_drift, "max_kld": max_kld},
        "recorded": recorded,
        "ppl_rtol": a.ppl_rtol,
        "checks": checks,
        "passed": ok,
        "exit_code": 0 if ok else 1,
    }


def format_report(r: dict[str, Any]) -> str:
    """The text report, in the manner of llama.cpp's perplexity tool."""
    q, b = r["quality"], r["bounds"]
    lo, hi = q["drift_ci95"]
    own = "the profile's own" if r["same_eval_text"] else "not the profile's"
    lines = [
        f"profile {r['profile']} on {r['device']}",
        f"eval text {r['eval_text']} (sha256 {r['eval_text_sha256'][:12]}, {own}): "
        f"{q['tokens']} tokens scored in {q['windows']} windows of {q['context']}",
        "",
        "====== Perplexity statistics ======",
        f"Final estimate: PPL(base) = {q['ppl_ref']:.4f} +/- {q['ppl_ref_err']:.5f}   (FP16 reference)",
        f"Final estimate: PPL(Q)    = {q['ppl']:.4f} +/- {q['ppl_err']:.5f}   (planned)",
        f"Mean PPL(Q)-PPL(base)     = {q['drift']:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}] (per-{q['method'][:-1]})",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {q['kld_mean']:10.6f} +/- {q['kld_err']:.6f}",
        f"99.0%   KLD: {q['kld_p99']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Same top p: {100 * q['top1']:.3f} +/- {100 * q['top1_err']:.3f} %",
        "",
    ]
    c = r["checks"]
    if r["recorded"] is None:
        why = "different eval text" if not r["same_eval_text"] else "different --max-tokens"
        lines.append(f"recorded PPL: not compared ({why})")
    else:
        rec = r["recorded"]
        lines.append(
            f"recorded PPL: base {rec['ppl_ref']:.4f}, Q {rec['ppl']:.4f}: "
            f"{'reproduced' if c['reproduced'] else 'NOT reproduced'} (rel tol {r['ppl_rtol']:g})"
        )
    lines.append(
        f"gate: |dPPL| {abs(q['drift']):.4f} {'<=' if c['drift'] else '>'} {b['max_drift']:g}, "
        f"KLD {q['kld_mean']:.6f} {'<=' if c['kld'] else '>'} {b['max_kld']:g}: "
        f"{'PASS' if r['passed'] else 'FAIL'}"
    )
    return "\n".join(lines)


def engines_for_profile(prof: Profile, device: str | None = None) -> tuple[Any, Any]:
    """(the profile's planned engine, the unquantized reference engine of its target)."""
    kw = engine_options(prof, device)
    planned = Engine.for_profile(prof, device)
    reference = Engine.from_pretrained(kw["target"], device=kw["device"])
    return planned, reference


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        a = parse_args(argv)
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        r = evaluate(a)
        print(json.dumps(r, indent=2) if a.json else format_report(r))
        return r["exit_code"]

    return run_tool(PROG, body)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Plan precision for a GPU, quantize, gate on perplexity/KLD, calibrate K, write a profile.

    python tools/build_profile.py --gpu a100                 # the demo pair (built when missing)
    python tools/build_profile.py --gpu h100 --target DIR --draft DIR --eval-text FILE --calib-text FILE
    python tools/build_profile.py --gpu a100 --target DIR    # no draft: the n-gram drafter

Steps: plan -> search the target's per-layer FFN plan on the calibration text (quant/search.py:
candidates by expected speed on the GPU, scored by KLD on calibration text; --no-search: the
precision section's plan as is) -> quantize -> quality gate on the eval text (dPPL and KLD of the
planned target against its unquantized self; a failing plan steps back -- searched plan -> W8A16
per group of 64 -> fp16 FFN; without the search w8a8 -> llm-int8 -> fp16 FFN -- unless
--no-fallback) -> calibrate speculation -> write profiles/<gpu>-<model>.json atomically,
with a Markdown build report (.md) and its plot (.png; skipped without matplotlib) beside it.
Exit status: 0 written; 1 no plan passed the gate (nothing written, an existing profile and
its report untouched); 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine import Engine
from engine.api.options import PrecisionConfig
from engine.api.profile_quality import FfnChoice, GateAttempt, QualityFigures, QualityGates
from engine.api.profile_sections import THROUGHPUT_RUNS, Speculation, Throughput
from engine.build.calibrate import calibrate
from engine.build.planner import DEFAULT_KLD_BUDGET, DEFAULT_MIN_TOP1
from engine.build.profile import PassedGate, ProfileInputs, make_profile, write_profile
from engine.build.quality import compare_models, default_context, load_eval_ids
from engine.build.throughput import ThroughputOptions, measure_throughput
from engine.core.cli import run_tool
from engine.core.config import load_config
from engine.core.errors import InvalidConfigError
from engine.core.files import write_bytes_atomic
from engine.spec_decode.heads.config import is_head_dir, read_head_config
from quant.catalog import gpu_for_device_name, lookup_gpu
from quant.plan import make_plan
from quant.plan_schema import DEFAULT_PRECISION

log = logging.getLogger("build_profile")
PROFILES = Path("profiles")  # relative to the working directory (run from the repository root)
WIKITEXT_TEST = Path("..") / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"  # from the repository root
TARGET_ONLY_EVAL_TOKENS = 8192
LOOKUP_HELP = (
    "with a draft: draft by prompt lookup where the last N or more tokens recur in the context, the draft elsewhere "
    "(speculation.prompt_lookup_min; calibrated with it)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", required=True, help="catalog name (quant/gpus.json, e.g. a100, h100, l4) or 'auto'")
    p.add_argument("--target", type=Path, help="target checkpoint directory (default: the demo pair)")
    p.add_argument(
        "--draft",
        type=Path,
        help="draft checkpoint directory, or a trained head directory "
        "(specmix-train-draft --kind medusa|eagle) (default: the demo pair)",
    )
    p.add_argument("--demo-size", default="demo", help="demo pair size when no models are given (demo|tiny)")
    p.add_argument("--eval-text", type=Path, help="evaluation text (default: the demo pair's held-out text)")
    p.add_argument("--calib-text", type=Path, help="calibration text, never the eval text (default: the demo's slice)")
    p.add_argument("--max-drift", type=float, default=0.3, help="bound on |dPPL| (default 0.3)")
    p.add_argument("--max-kld", type=float, default=0.01, help="bound on mean KLD (default 0.01)")
    p.add_argument(
        "--max-eval-tokens",
        type=int,
        default=None,
        help=f"cap on eval tokens (default: all; {TARGET_ONLY_EVAL_TOKENS} for a --target without "
        "--eval-text, which evaluates on WikiText-2 test)",
    )
    p.add_argument("--no-fallback", action="store_true", help="fail instead of stepping the plan back")
    p.add_argument("--no-search", action="store_true", help="keep the precision section's plan (no per-layer search)")
    p.add_argument(
        "--int8-kernel",
        choices=("w8a8", "llm-int8", "w8a16"),
        default="w8a8",
        help="with --no-search: the FFN's INT8 kernel of the first plan tried (default w8a8)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="with --no-search --int8-kernel w8a16: input channels per weight scale (default: per channel)",
    )
    p.add_argument(
        "--plan-kld-budget",
        type=float,
        default=DEFAULT_KLD_BUDGET,
        help=f"the search's bound on mean KLD on the calibration text (default {DEFAULT_KLD_BUDGET})",
    )
    p.add_argument(
        "--plan-min-top1",
        type=float,
        default=DEFAULT_MIN_TOP1,
        help=f"the search's bound on top-1 agreement on the calibration text (default {DEFAULT_MIN_TOP1})",
    )
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="N", help=LOOKUP_HELP)
    p.add_argument(
        "--throughput-rounds",
        type=int,
        default=ThroughputOptions.rounds,
        metavar="N",
        help="time the planned models' decoding against the unquantized ones over N rounds (0: skip the check)",
    )
    p.add_argument("--out", type=Path, help="output file (default profiles/<gpu>-<model>.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="build and check on it (default: cuda if any, else cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def resolve_gpu(name: str) -> dict[str, Any]:
    if name == "auto":
        from engine.kernels.backends import detect_gpu_name

        return gpu_for_device_name(detect_gpu_name())
    return lookup_gpu(name)


def resolve_inputs(a: argparse.Namespace, gpu: dict[str, Any], device: str) -> ProfileInputs:
    """Model directories, texts, the profile's name and the gate's bounds; the demo pair when no models are given."""
    if a.draft is not None and a.target is None:
        raise InvalidConfigError("--draft needs --target (without both: the demo pair)")
    demo, max_eval_tokens = None, a.max_eval_tokens
    if a.target is None:
        from engine.demo.pair import demo_pair

        target, draft = demo_pair(a.demo_size, progress=not a.quiet)
        root = target.parent
        demo = (a.demo_size, root)
        name = "demo" if a.demo_size == "demo" else f"demo-{a.demo_size}"
        eval_path = a.eval_text or root / "heldout.txt"
        calib_path = a.calib_text or root / "calib.txt"
    elif a.draft is None:  # a target alone: the n-gram drafter
        if a.prompt_lookup is not None:
            raise InvalidConfigError("--prompt-lookup needs --draft (a target alone drafts by prompt lookup already)")
        target, draft, name = a.target, None, a.target.resolve().name.lower()
        if a.eval_text is None and not WIKITEXT_TEST.is_file():
            raise InvalidConfigError(f"--eval-text is required: the default {WIKITEXT_TEST} is missing")
        eval_path = a.eval_text or WIKITEXT_TEST
        if a.eval_text is None and a.max_eval_tokens is None:
            max_eval_tokens = TARGET_ONLY_EVAL_TOKENS
        calib_path = a.calib_text or default_calib_text()
    else:
        target, draft, name = a.target, a.draft, a.target.resolve().name.lower()
        if a.eval_text is None or a.calib_text is None:
            raise InvalidConfigError("--eval-text and --calib-text are required with --target/--draft")
        eval_path, calib_path = a.eval_text, a.calib_text
    texts = {}
    for what, path in (("eval-text", eval_path), ("calib-text", calib_path)):
        try:
            texts[what] = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidConfigError(f"--{what} {path}: unreadable ({e.__class__.__name__}: {e})") from None
    if hashlib.sha256(texts["eval-text"].encode()).digest() == hashlib.sha256(texts["calib-text"].encode()).digest():
        raise InvalidConfigError("--calib-text is the eval text: calibration must never use the eval text")
    return ProfileInputs(
        name=Path(a.out).stem if a.out else f"{gpu['name']}-{name}",
        gpu=gpu,
        device=device,
        target=Path(target),
        draft=None if draft is None else Path(draft),
        eval_path=Path(eval_path),
        eval_text=texts["eval-text"],
        calib_path=Path(calib_path),
        calib_text=texts["calib-text"],
        gates=QualityGates(max_drift=a.max_drift, max_kld=a.max_kld),
        max_eval_tokens=max_eval_tokens,
        demo=demo,
    )


def default_calib_text() -> Path:
    """The demo corpus's training split (CPython's pydoc topics) as a file in the specmix cache."""
    from engine.core.files import default_cache_dir
    from engine.demo.recipe import demo_texts

    path = default_cache_dir() / "calib" / "pydoc-train.txt"
    text = demo_texts()["train"]
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, text.encode("utf-8"))
    return path


def ladder(a: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    fp16_ffn = {
        "draft_model": DEFAULT_PRECISION["draft_model"],
        "main_model": {"attention": "fp16", "ffn": "fp16"},
        "verifier": "fp16",
    }
    if a.no_search:
        first = {
            "w8a8": "int8 w8a8 + SmoothQuant",
            "llm-int8": "int8 llm-int8",
            "w8a16": "int8 w8a16 " + (f"per group of {a.group_size}" if a.group_size else "per channel"),
        }
        steps = [(first[a.int8_kernel], {"int8_kernel": a.int8_kernel, "group_size": a.group_size})]
        if a.int8_kernel == "w8a8":
            steps.append(("int8 llm-int8", {"int8_kernel": "llm-int8"}))
    else:
        steps = [
            ("planner: per-layer search", {"search": True}),
            ("int8 w8a16 per group of 64", {"int8_kernel": "w8a16", "group_size": 64}),
        ]
    steps.append(("fp16 FFN", {"precision": fp16_ffn}))
    return steps[:1] if a.no_fallback else steps


def run_gate(a: argparse.Namespace, inp: ProfileInputs) -> tuple[PassedGate | None, list[GateAttempt]]:
    """Try the plans in order; return (the first passing plan or None, every attempt)."""
    # a trained head (specmix-train-draft --kind medusa|eagle) is the draft: the plan's draft part is the head's
    tcfg = load_config(inp.target)
    head = inp.draft is not None and is_head_dir(inp.draft)
    dcfg = None if inp.draft is None or head else load_config(inp.draft)
    draft_head = dataclasses.asdict(read_head_config(inp.draft)) if head else None
    ref = Engine.from_pretrained(inp.target, device=inp.device)
    ids = load_eval_ids(ref.tokenizer, inp.eval_text, max_tokens=inp.max_eval_tokens)
    context = default_context(tcfg.max_position_embeddings)
    attempts = []
    for label, kw in ladder(a):
        kw = dict(kw)
        search = kw.pop("search", False)
        plan = make_plan(inp.gpu, tcfg, dcfg, device=inp.device, draft_head=draft_head, **kw)
        record = None
        if search and plan.target.families["ffn"].quantized:
            from engine.build.planner import search_plan

            plan, record = search_plan(
                inp.target,
                plan,
                inp.calib_text,
                inp.gpu,
                device=inp.device,
                kld_budget=a.plan_kld_budget,
                min_top1=a.plan_min_top1,
                draft_dir=None if dcfg is None else inp.draft,  # no draft model: no draft part to plan
            )
        ffn = plan.target.families["ffn"]
        precision = PrecisionConfig(plan, inp.calib_text).target_only()
        planned = Engine.from_pretrained(inp.target, device=inp.device, precision=precision)
        rep = compare_models(ref.logits, planned.logits, ids, context, progress=not a.quiet)
        ok = rep.passes(inp.gates.max_drift, inp.gates.max_kld)
        figures = QualityFigures.from_dict(rep.to_dict(), "quality")
        attempts.append(GateAttempt(label, FfnChoice(ffn.storage, ffn.kernel), figures, ok, record or None))
        log.info(
            "gate %s: dPPL %+.4f, KLD %.5f, top-1 %.4f -> %s",
            label,
            rep.drift,
            rep.kld_mean,
            rep.top1,
            "pass" if ok else "fail",
        )
        if ok:
            return PassedGate(plan, figures, tuple(attempts)), attempts
    return None, attempts


def build(a: argparse.Namespace) -> int:
    if not 0 <= a.throughput_rounds <= 100:
        raise InvalidConfigError(f"--throughput-rounds={a.throughput_rounds} is invalid: allowed an int in 0..100")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError("--device cuda: no CUDA device on this machine; use --device cpu")
    inp = resolve_inputs(a, resolve_gpu(a.gpu), device)
    out = Path(a.out or PROFILES / f"{inp.name}.json")
    passed, attempts = run_gate(a, inp)
    if passed is None:
        print(summary_table(attempts), file=sys.stderr)
        print(
            f"build_profile: no plan passed the gate (|dPPL| <= {a.max_drift}, KLD <= {a.max_kld}); "
            f"nothing written to {out}",
            file=sys.stderr,
        )
        return 1
    d = inp.draft
    drafter = "ngram" if d is None else read_head_config(d).kind if is_head_dir(d) else "model"
    spec = calibrate(inp.target, d, passed.plan, inp.calib_text, device=device, drafter=drafter, lookup=a.prompt_lookup)
    tput = None
    if a.throughput_rounds:
        opts = ThroughputOptions(rounds=a.throughput_rounds)
        tput = measure_throughput(inp.target, d, passed.plan, inp.calib_text, spec.config, device=device, opts=opts)
    written = write_profile(make_profile(inp, passed, spec, tput), out)
    print(summary_table(attempts))
    print(speculation_line(spec))
    if tput is not None:
        print(throughput_line(tput))
    print(f"wrote {out}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def speculation_line(spec: Speculation) -> str:
    cfg, m = spec.config, spec.measured
    fp16 = f" (fp16 draft {m.acceptance_fp16_draft:.3f})" if m.acceptance_fp16_draft is not None else ""
    c = f"{cfg.costs.c:.3f}" if cfg.costs is not None else "-"
    return (
        f"speculation: {cfg.drafter} K={cfg.k} in [{cfg.k_min}, {cfg.resolved_k_max}], acceptance "
        f"{m.acceptance:.3f}{fp16}, c={c}, predicted speedup {m.predicted_speedup:.2f}x"
    )


def throughput_line(t: Throughput) -> str:
    base = t.unquantized_plain.tokens_per_s
    runs = ((n.replace("_", " "), getattr(t, n)) for n in THROUGHPUT_RUNS)
    return "throughput (tokens/s, x unquantized plain): " + ", ".join(
        f"{name} {r.tokens_per_s:.1f} ({r.tokens_per_s / base:.2f}x)" for name, r in runs
    )


def summary_table(attempts: Sequence[GateAttempt]) -> str:
    rows = [("plan", "PPL ref", "PPL", "dPPL (95% CI)", "KLD mean", "KLD p99", "top-1", "gate")]
    for t in attempts:
        f = t.figures
        lo, hi = f.drift_ci95
        rows.append(
            (
                t.plan,
                f"{f.ppl_ref:.4f}",
                f"{f.ppl:.4f}",
                f"{f.drift:+.4f} ({lo:+.4f}, {hi:+.4f})",
                f"{f.kld_mean:.5f}",
                f"{f.kld_p99:.5f}",
                f"{f.top1:.4f}",
                "pass" if t.passed else "FAIL",
            )
        )
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    return run_tool("build_profile", lambda: build(a), interrupted="interrupted; nothing written")


if __name__ == "__main__":
    sys.exit(main())

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
import datetime as dt
import hashlib
import logging
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import engine
from engine import Engine
from engine.api.options import KernelOptions, Limits, LoadWindowConfig, PrecisionConfig, runtime_to_profile
from engine.api.profile import PROFILE_SCHEMA_VERSION, model_ref, weight_hashes
from engine.build.calibrate import calibrate
from engine.build.planner import DEFAULT_KLD_BUDGET, DEFAULT_MIN_TOP1
from engine.build.quality import compare_models, load_eval_ids
from engine.build.report import build_report_files
from engine.core.cli import run_tool
from engine.core.config import load_config
from engine.core.errors import InvalidConfigError
from engine.core.files import write_bytes_atomic, write_json_atomic
from engine.spec_decode.heads.checkpoint import is_head_dir, read_head_config
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
    p.add_argument("--out", type=Path, help="output file (default profiles/<gpu>-<model>.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="build and check on it (default: cuda if any, else cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def resolve_gpu(name: str) -> dict[str, Any]:
    if name == "auto":
        from engine.kernels.backends import detect_gpu_name

        return gpu_for_device_name(detect_gpu_name())
    return lookup_gpu(name)


def resolve_inputs(a: argparse.Namespace) -> dict[str, Any]:
    """Model directories, texts and the profile's model name; the demo pair when no models are given."""
    if a.draft is not None and a.target is None:
        raise InvalidConfigError("--draft needs --target (without both: the demo pair)")
    demo = None
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
            a.max_eval_tokens = TARGET_ONLY_EVAL_TOKENS
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
    return {
        "target": Path(target),
        "draft": None if draft is None else Path(draft),
        "name": name,
        "demo": demo,
        "eval_path": Path(eval_path),
        "calib_path": Path(calib_path),
        "eval_text": texts["eval-text"],
        "calib_text": texts["calib-text"],
    }


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


def run_gate(a: argparse.Namespace, inp: dict[str, Any], gpu: dict[str, Any], device: str) -> tuple[Any, list]:
    """Try the plans in order; return (the first passing plan or None, every attempt's record)."""
    # a trained head (specmix-train-draft --kind medusa|eagle) is the draft: the plan's draft part is the head's
    tcfg = load_config(inp["target"])
    head = inp["draft"] is not None and is_head_dir(inp["draft"])
    dcfg = None if inp["draft"] is None or head else load_config(inp["draft"])
    draft_head = dataclasses.asdict(read_head_config(inp["draft"])) if head else None
    ref = Engine.from_pretrained(inp["target"], device=device)
    ids = load_eval_ids(ref.tokenizer, inp["eval_text"], max_tokens=a.max_eval_tokens)
    context = min(512, tcfg.max_position_embeddings)
    attempts = []
    for label, kw in ladder(a):
        kw = dict(kw)
        search = kw.pop("search", False)
        plan = make_plan(gpu, tcfg, dcfg, device=device, draft_head=draft_head, **kw)
        record = None
        if search and plan.target.families["ffn"].quantized:
            from engine.build.planner import search_plan

            plan, record = search_plan(
                inp["target"],
                plan,
                inp["calib_text"],
                gpu,
                device=device,
                kld_budget=a.plan_kld_budget,
                min_top1=a.plan_min_top1,
                draft_dir=None if dcfg is None else inp["draft"],  # no draft model: no draft part to plan
            )
        ffn = plan.target.families["ffn"]
        precision = PrecisionConfig(dataclasses.replace(plan, draft=None), inp["calib_text"])
        planned = Engine.from_pretrained(inp["target"], device=device, precision=precision)
        rep = compare_models(ref.logits, planned.logits, ids, context, progress=not a.quiet)
        ok = rep.passes(a.max_drift, a.max_kld)
        attempts.append(
            {
                "plan": label,
                "ffn": {"storage": ffn.storage, "kernel": ffn.kernel},
                **rep.to_dict(),
                "passed": ok,
                **({"search": record} if record else {}),
            }
        )
        log.info(
            "gate %s: dPPL %+.4f, KLD %.5f, top-1 %.4f -> %s",
            label,
            rep.drift,
            rep.kld_mean,
            rep.top1,
            "pass" if ok else "fail",
        )
        if ok:
            return (plan, rep, context, len(ids)), attempts
    return None, attempts


def build(a: argparse.Namespace) -> int:
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidConfigError("--device cuda: no CUDA device on this machine; use --device cpu")
    gpu = resolve_gpu(a.gpu)
    inp = resolve_inputs(a)
    out = a.out or PROFILES / f"{gpu['name']}-{inp['name']}.json"
    passed, attempts = run_gate(a, inp, gpu, device)
    if passed is None:
        print(summary_table(attempts), file=sys.stderr)
        print(
            f"build_profile: no plan passed the gate (|dPPL| <= {a.max_drift}, KLD <= {a.max_kld}); "
            f"nothing written to {out}",
            file=sys.stderr,
        )
        return 1
    plan, rep, context, n_tokens = passed
    d = inp["draft"]
    drafter = "ngram" if d is None else read_head_config(d).kind if is_head_dir(d) else "model"
    spec = calibrate(inp["target"], d, plan, inp["calib_text"], device=device, drafter=drafter, lookup=a.prompt_lookup)
    profile = make_profile(gpu, device, inp, plan, rep, attempts, spec, context, n_tokens, a)
    report = build_report_files(profile, Path(out))  # rendered before anything is written
    write_json_atomic(Path(out), profile)
    for path, data in report.items():
        if data is not None:
            write_bytes_atomic(path, data)
        elif path.exists():  # a plot of an older build would not match this profile
            log.info("removing the stale plot %s (this build has none)", path)
            path.unlink()
    print(summary_table(attempts))
    fp16 = f" (fp16 draft {spec['acceptance_fp16_draft']:.3f})" if "acceptance_fp16_draft" in spec else ""
    print(
        f"speculation: {spec['drafter']} K={spec['k']} in [{spec['k_min']}, {spec['k_max']}], acceptance "
        f"{spec['acceptance']:.3f}{fp16}, c={spec['c']:.3f}, "
        f"predicted speedup {spec['predicted_speedup']:.2f}x"
    )
    print(f"wrote {out}")
    print("wrote " + ", ".join(str(p) for p, d in report.items() if d is not None))
    return 0


def _model_config(model_dir: Path) -> dict[str, Any]:
    """A checkpoint's ModelConfig, or a trained head's config (engine/spec_decode/heads/checkpoint.py)."""
    if is_head_dir(model_dir):
        return dataclasses.asdict(read_head_config(model_dir))
    return load_config(model_dir).to_dict()


def make_profile(gpu, device, inp, plan, rep, attempts, spec, context, n_tokens, a) -> dict[str, Any]:
    m = plan.memory
    ref = lambda p: model_ref(p, inp["demo"])
    validated = (
        torch.cuda.get_device_name() if device == "cuda" else f"cpu: {platform.processor() or platform.machine()}"
    )
    return {
        "schema_version": PROFILE_SCHEMA_VERSION,
        "name": Path(a.out).stem if a.out else f"{gpu['name']}-{inp['name']}",
        "gpu": gpu,
        "validated_on": validated,
        "device": device,
        "models": {
            role: None
            if inp[role] is None
            else {"path": ref(inp[role]), "sha256": weight_hashes(inp[role]), "config": _model_config(inp[role])}
            for role in ("target", "draft")
        },
        "precision": plan.precision,
        "plan": plan.to_dict(),
        "memory": {
            "target": {"bytes": m.target_weight_bytes, "fp16_bytes": m.target_fp16_bytes},
            "draft": {"bytes": m.draft_weight_bytes, "fp16_bytes": m.draft_fp16_bytes}
            if inp["draft"] is not None
            else None,
            "kv_cache_bytes": m.kv_cache_bytes,
            "budget_bytes": m.budget_bytes,
            "max_batch": m.max_batch,
            "max_seq_len": m.max_seq_len,
        },
        "quality": {
            **{k: v for k, v in rep.to_dict().items()},
            "context": context,
            "max_tokens": a.max_eval_tokens,
            "eval_text": ref(inp["eval_path"]),
            "eval_text_sha256": hashlib.sha256(inp["eval_text"].encode()).hexdigest(),
            "gates": {"max_drift": a.max_drift, "max_kld": a.max_kld},
            "attempts": attempts,
        },
        "calibration": {
            "text": ref(inp["calib_path"]),
            "sha256": hashlib.sha256(inp["calib_text"].encode()).hexdigest(),
        },
        "speculation": spec,
        # how the engine runs the plan: CUDA graphs where the profile's device is a GPU (never on the
        # CPU), and the load-aware window (lower K and the batch above this GPU memory use)
        "runtime": runtime_to_profile(
            KernelOptions(cuda_graphs=device == "cuda"), Limits(load_window=LoadWindowConfig())
        ),
        "versions": {"torch": torch.__version__, "specmix": engine.__version__},
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def summary_table(attempts: list[dict[str, Any]]) -> str:
    rows = [("plan", "PPL ref", "PPL", "dPPL (95% CI)", "KLD mean", "KLD p99", "top-1", "gate")]
    for t in attempts:
        lo, hi = t["drift_ci95"]
        rows.append(
            (
                t["plan"],
                f"{t['ppl_ref']:.4f}",
                f"{t['ppl']:.4f}",
                f"{t['drift']:+.4f} ({lo:+.4f}, {hi:+.4f})",
                f"{t['kld_mean']:.5f}",
                f"{t['kld_p99']:.5f}",
                f"{t['top1']:.4f}",
                "pass" if t["passed"] else "FAIL",
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

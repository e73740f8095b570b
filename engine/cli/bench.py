#!/usr/bin/env python
"""Decode speed of plain, speculative and transformers generation on one pair.

    python tools/bench.py [--target DIR --draft DIR] [--medusa DIR] [--eagle DIR] [--prompts FILE] [--json FILE]
                          [--plot FILE.png]

--medusa / --eagle: trained heads for the target (specmix-train-draft) add the modes specmix-medusa /
specmix-eagle; their rows report the head's measured draft cost c beside the draft model's.

--prompt-lookup N adds, for each drafter mode but n-gram, a mode <mode>+lookup: prompt lookup first where
the last N or more tokens recur in the context and copies have drafted better (engine/spec_decode/drafters/lookup.py).

--sweep-k 1,2,4 adds the draft-model drafter at each fixed K (adaptive K off) as modes
specmix-model-k1, ... (and each trained head given: specmix-medusa-k1, specmix-eagle-k1, ...);
--plot draws speedup vs K (measured and predicted by the cost model), acceptance per draft
position and tokens/s per mode (needs matplotlib: the `plot` extra).

Same prompts and max_new_tokens for every mode, greedy, batch 1 (the prompts run one
after another). Modes are interleaved within each repeat; one warm-up round, then
--repeats rounds; figures are medians. Speedups are ratios within this one run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine import Engine
from engine.api.options import KernelOptions, SpeculationConfig
from engine.build.plots import aggregate_positions, bench_series, draw_bench, require_matplotlib
from engine.cli.bench_modes import hf_runner, match_rate, print_table, spec_runner, sweep_summary
from engine.core.cli import run_tool
from engine.core.errors import InvalidConfigError
from engine.spec_decode.adaptive import best_k, expected_speedup

SPEC_MODES = {
    "specmix-model": "model",
    "specmix-ngram": "ngram",
    "specmix-early-exit": "early-exit",
    "specmix-medusa": "medusa",
    "specmix-eagle": "eagle",
}  # the heads' modes need --medusa / --eagle
HF_MODES = ("hf-plain", "hf-assisted", "hf-assisted-k5")
DEFAULT_SWEEP = "1,2,4,6,8"  # --sweep-k when --plot is given
DTYPES = ("float32", "bfloat16")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path)
    p.add_argument("--draft", type=Path)
    p.add_argument(
        "--medusa",
        type=Path,
        help="trained Medusa heads (specmix-train-draft --kind medusa): adds the specmix-medusa mode",
    )
    p.add_argument(
        "--eagle",
        type=Path,
        help="a trained EAGLE-style head (specmix-train-draft --kind eagle): adds the specmix-eagle mode",
    )
    p.add_argument("--demo-size", default="demo")
    p.add_argument("--prompts", type=Path, help="one prompt per line (default: 4 from the demo held-out text)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the target's dtype for every mode, transformers' too (default float32; the draft stays "
        "float32 on the CPU). bfloat16 is not token-identical to float32: the table then "
        "reports each mode's greedy match rate against the float32 target",
    )
    p.add_argument("--modes", default=None, help="comma-separated subset of modes")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers modes")
    p.add_argument(
        "--attention",
        default=None,
        help="the target's attention backend (default: the engine's "
        "choice: math with --dtype bfloat16, which keeps speculation exact; sdpa is faster, not exact)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        default=None,
        metavar="N",
        help="adds a mode <mode>+lookup for each drafter but ngram: prompt lookup first where the last N or more "
        "tokens recur in the context, the drafter elsewhere (speculation.prompt_lookup_min)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path, help="write a PNG figure (needs matplotlib: pip install 'specmix[plot]')")
    p.add_argument(
        "--sweep-k",
        default=None,
        help=f"comma-separated fixed K values for the draft-model drafter and each trained head, adaptive K off "
        f"(default {DEFAULT_SWEEP} with --plot, none without; '' for none)",
    )
    return p.parse_args(argv)


def parse_sweep(a: argparse.Namespace) -> list[int]:
    spec = a.sweep_k if a.sweep_k is not None else (DEFAULT_SWEEP if a.plot else "")
    try:
        ks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        ks = [0]
    if any(k < 1 for k in ks):
        raise InvalidConfigError(
            f"--sweep-k={spec!r} is invalid: allowed comma-separated ints >= 1, e.g. {DEFAULT_SWEEP}"
        )
    return ks


def load_prompts(a: argparse.Namespace, root: Path | None) -> list[str]:
    if a.prompts is not None:
        try:
            lines = [ln.strip() for ln in a.prompts.read_text(encoding="utf-8").splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidConfigError(f"--prompts {a.prompts}: unreadable ({e})") from None
        if not lines:
            raise InvalidConfigError(f"--prompts {a.prompts}: no prompts in the file")
        return lines
    if root is None:
        raise InvalidConfigError("--prompts is required with --target/--draft")
    text = (root / "heldout.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200]
    step = max(1, len(paras) // 4)
    return [paras[i * step][:160] for i in range(4)]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return run_tool("bench", lambda: bench(a))


def bench(a: argparse.Namespace) -> int:
    sweep = parse_sweep(a)
    if a.plot is not None:
        require_matplotlib("--plot")  # before any benchmarking
    if a.threads:
        torch.set_num_threads(a.threads)
    root = None
    if a.target is None:
        from engine.demo.pair import demo_pair

        target, draft = demo_pair(a.demo_size)
        root = target.parent
    else:
        target, draft = a.target, a.draft
    prompts = load_prompts(a, root)
    n = a.max_new_tokens
    dt = a.dtype
    opts = {"dtype": dt, "kernels": KernelOptions(attention=a.attention)}
    engines: dict[str, Engine] = {"plain": Engine.from_pretrained(target, **opts)}
    heads = {"medusa": a.medusa, "eagle": a.eagle}
    for mode, drafter in SPEC_MODES.items():
        if (drafter in heads and heads[drafter] is None) or (drafter == "model" and draft is None):
            continue
        engines[mode] = Engine.from_pretrained(
            target,
            draft if drafter == "model" else heads.get(drafter),
            speculation=SpeculationConfig(drafter=drafter, k=a.k),
            **opts,
        )
    lookup_modes = {}  # prompt lookup first, then the mode's drafter
    for mode, drafter in SPEC_MODES.items():
        if a.prompt_lookup is None or drafter == "ngram" or mode not in engines:
            continue
        spec = SpeculationConfig(drafter=drafter, k=a.k, prompt_lookup_min=a.prompt_lookup, costs=engines[mode].costs)
        lookup_modes[f"{mode}+lookup"] = mode
        engines[f"{mode}+lookup"] = Engine.from_pretrained(
            target, draft if drafter == "model" else heads.get(drafter), speculation=spec, **opts
        )
    model_sweep = sweep if "specmix-model" in engines else []  # no draft model: the heads' sweeps only
    costs = engines["specmix-model"].costs if model_sweep else None  # measured once, shared by the sweep
    sweep_modes = {f"specmix-model-k{k}": k for k in model_sweep}
    for mode, k in sweep_modes.items():
        engines[mode] = Engine.from_pretrained(
            target, draft, speculation=SpeculationConfig(k=k, k_policy="constant", costs=costs), **opts
        )
    head_sweep: dict[str, int] = {}  # fixed K for the heads: kept out of the draft model's sweep summary
    for kind, head_dir in heads.items():
        for k in sweep if head_dir is not None else []:
            head_sweep[f"specmix-{kind}-k{k}"] = k
            spec = SpeculationConfig(drafter=kind, k=k, k_policy="constant", costs=engines[f"specmix-{kind}"].costs)
            engines[f"specmix-{kind}-k{k}"] = Engine.from_pretrained(target, head_dir, speculation=spec, **opts)
    sinks: dict[str, list[dict[str, Any]]] = {m: [] for m in engines if m != "plain"}
    outputs: dict[str, list[list[int]]] = {m: [] for m in engines}
    runners: dict[str, Callable[[], tuple[int, float]]] = {
        m: spec_runner(e, prompts, n, sinks.get(m), outputs[m]) for m, e in engines.items()
    }
    hf_counts = {}
    have_hf = not a.no_hf
    if have_hf:
        try:
            import transformers  # noqa: F401
        except ImportError:
            have_hf = False
    if have_hf:
        for mode in HF_MODES if draft is not None else ["hf-plain"]:  # assisted generation needs a draft
            runners[mode], hf_counts[mode] = hf_runner(target, draft, prompts, n, mode, a.k, getattr(torch, dt))
    if a.modes:
        keep = set(a.modes.split(",")) | {"plain"} | set(sweep_modes) | set(head_sweep)
        keep |= {m for m, base in lookup_modes.items() if base in keep}
        runners = {m: r for m, r in runners.items() if m in keep}
    for r in runners.values():  # warm-up
        r()
    for e in engines.values():
        e.reset_stats()  # count only the measured repeats
    for sink in sinks.values():
        sink.clear()
    for c in hf_counts.values():
        c.update(target=0, draft=0)
    rates: dict[str, list[float]] = {m: [] for m in runners}
    for _ in tqdm(range(a.repeats), desc="repeats"):
        for m, r in runners.items():
            toks, secs = r()
            rates[m].append(toks / secs)
    plain = statistics.median(rates["plain"])
    reference = outputs["plain"]  # greedy outputs of the target alone, in --dtype
    if dt != "float32":  # ... and of the float32 target, which the reduced precision is measured against
        reference = []
        spec_runner(Engine.from_pretrained(target), prompts, n, outputs=reference)()
    modes = []
    for m in runners:
        tps = statistics.median(rates[m])
        row: dict[str, Any] = {
            "name": m,
            "tokens_per_s": tps,
            "speedup_vs_plain": tps / plain,
            "acceptance_rate": None,
            "mean_accepted_length": None,
            "predicted_speedup": None,
            "repeats": rates[m],
            "fixed_k": sweep_modes.get(m, head_sweep.get(m)),
        }
        if m in outputs:  # spec vs the target alone in this dtype (1.0 in float32), and vs the float32 target
            row["match_vs_plain"] = match_rate(outputs[m], outputs["plain"])
            row["match_vs_float32"] = match_rate(outputs[m], reference)
        if m in sinks:
            pos = aggregate_positions(sinks[m])
            row["per_position_acceptance"], row["per_position_requests"] = pos["acceptance"], pos["requests"]
        if m in sweep_modes or m in head_sweep:
            st = engines[m].stats()
            row["acceptance_rate"], row["mean_accepted_length"] = st["acceptance_rate"], st["mean_accepted_length"]
        if (m in SPEC_MODES or m in lookup_modes) and m in engines:
            st, eng = engines[m].stats(), engines[m]
            row["acceptance_rate"], row["mean_accepted_length"] = st["acceptance_rate"], st["mean_accepted_length"]
            row["token_acceptance"] = st["token_acceptance"]
            if st["token_acceptance"] is not None and eng.costs is not None:
                acc = st["token_acceptance"]  # the cost model's per-token a (accepted / drafted is biased low)
                k = best_k(min(acc, 0.999), eng.costs, 1, eng.policy.k_max)
                row["predicted_speedup"] = expected_speedup(acc, k, eng.costs)
                row["costs"] = eng.costs.to_dict()
        if m in hf_counts and m != "hf-plain":
            c = hf_counts[m]
            row["draft_forwards_per_target_forward"] = c["draft"] / max(1, c["target"])
        modes.append(row)
    sweep_result = sweep_summary(modes, sweep_modes, sinks, costs)
    spec_info = engines["specmix-model"].info if "specmix-model" in engines else {}  # the draft model's settings
    print_table(modes)
    result = {
        "modes": modes,
        "pair": {"target": str(target), "draft": None if draft is None else str(draft)},
        "settings": {
            "max_new_tokens": n,
            "repeats": a.repeats,
            "k": a.k,
            "prompts": prompts,
            "threads": torch.get_num_threads(),
            "greedy": True,
            "dtype": dt,
            "draft_dtype": spec_info.get("draft_dtype"),
            "attention": engines["plain"].info["attention"],
            "cpu_linear_kernel": engines["plain"].info.get("cpu_linear_kernel"),
            "cpu_decode_step": spec_info.get("cpu_decode_step"),
            **{
                k: spec_info.get(k)
                for k in ("target_step_weights", "target_step_amx", "draft_step_weights", "draft_step_amx")
            },
            "batch": 1,
            "sweep_k": sweep,
        },
        "sweep": sweep_result,
    }
    from engine.core.files import write_bytes_atomic, write_json_atomic

    if a.json:
        write_json_atomic(a.json, result)
    if a.plot is not None:
        write_bytes_atomic(a.plot, draw_bench(bench_series(result)))
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Decode speed of plain, speculative and transformers generation on one pair.

    python tools/bench.py [--target DIR --draft DIR] [--medusa DIR] [--eagle DIR] [--prompts FILE | --workload FILE]
                          [--json FILE] [--plot FILE.png]

--medusa / --eagle: trained heads for the target (specmix-train-draft) add the modes specmix-medusa /
specmix-eagle; their rows report the head's measured draft cost c beside the draft model's.

--prompt-lookup N adds, for each drafter mode but n-gram, a mode <mode>+lookup: prompt lookup first where
the last N or more tokens recur in the context and copies have drafted better (engine/spec_decode/drafters/lookup.py).

--sweep-k 1,2,4 adds the draft-model drafter at each fixed K (adaptive K off) as modes
specmix-model-k1, ... (and each trained head given: specmix-medusa-k1, specmix-eagle-k1, ...);
--plot draws speedup vs K (measured and predicted by the cost model), acceptance per draft
position and tokens/s per mode (needs matplotlib: the `plot` extra).

--workload FILE.jsonl (tools/make_workload.py; examples/workload/workload.jsonl): chat prompts by category rendered
with the target's chat template (a target without one is refused); each mode's run runs the categories one after
another, and a table per category (and the --json "categories") gives tokens/s, speedup vs plain, acceptance,
mean accepted length and acceptance per draft position (engine/cli/bench_workload.py).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine import Engine
from engine.api.options import KernelOptions, Limits, SpeculationConfig
from engine.build.plots import aggregate_positions, bench_series, draw_bench, require_matplotlib
from engine.cli.bench_args import HEAD_KINDS, load_prompts, parse_args, parse_sweep
from engine.cli.bench_modes import Prompt, hf_runners, match_rate, print_table, spec_runner, sweep_summary
from engine.cli.bench_workload import Split, WorkloadItem, check_template, load_workload, print_categories
from engine.core.cli import run_tool
from engine.core.errors import InvalidConfigError
from engine.spec_decode.adaptive import Costs, best_k, expected_speedup
from engine.spec_decode.drafters.suffix_index import SuffixDecodingUnavailableError
from engine.spec_decode.registry import DRAFTERS, DrafterEntry, Loads

log = logging.getLogger(__name__)
SPEC_MODES = {f"specmix-{e.name}": e for e in DRAFTERS}  # one mode per drafter; a head's needs --<its name>
HF_MODES = ("hf-plain", "hf-assisted", "hf-assisted-k5")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv, __doc__)
    logging.basicConfig(level=logging.WARNING)
    return run_tool("bench", lambda: bench(a))


@dataclass(frozen=True)
class _Modes:
    """The engines of one run by mode name, and which modes are which."""

    engines: dict[str, Engine]
    """Every specmix mode's engine: "plain" first, then the drafters, their +lookup modes and the fixed-K sweeps."""
    lookup: dict[str, str]
    """Each variant of a drafter mode (<mode>+lookup, <mode>+tree): its base mode."""
    sweep: dict[str, int]
    """The draft model's fixed-K modes (specmix-model-k<K>): their K."""
    head_sweep: dict[str, int]
    """The trained heads' fixed-K modes (specmix-<kind>-k<K>): their K, kept out of the sweep summary."""
    costs: Costs | None
    """The draft model's measured costs, shared by its sweep; None without a sweep."""


@dataclass(frozen=True)
class _Runs:
    """What the repeats call and what they leave behind, by mode name."""

    runners: dict[str, Callable[[], tuple[int, float]]]
    """One run of every prompt: (tokens generated, seconds); --modes applied."""
    sinks: dict[str, list[dict[str, Any]]]
    """Every specmix mode but plain: the Completion stats of its measured runs."""
    outputs: dict[str, list[list[int]]]
    """Every specmix mode: the token ids of its latest run."""
    hf_counts: dict[str, dict[str, int]]
    """The transformers modes: their target and draft forward counts."""


def _pair(a: argparse.Namespace) -> tuple[Path, Path | None, Path | None]:
    """(target, draft, the demo pair's directory or None): --target/--draft, else the demo pair."""
    if a.target is not None:
        return a.target, a.draft, None
    from engine.demo.pair import demo_pair

    target, draft = demo_pair(a.demo_size)
    return target, draft, target.parent


def _heads(a: argparse.Namespace) -> dict[str, Path | None]:
    """The trained head given for each head kind (--<kind>), or None."""
    return {kind: vars(a)[kind.replace("-", "_")] for kind in HEAD_KINDS}


def _draft_arg(entry: DrafterEntry, draft: Path | None, heads: dict[str, Path | None]) -> tuple[bool, Path | None]:
    """(whether the mode can run, the ``draft`` argument its engine takes)."""
    if entry.loads is Loads.DRAFT_MODEL:
        return draft is not None, draft
    if entry.loads is Loads.HEAD:
        return heads[entry.name] is not None, heads[entry.name]
    return True, None


def _own_only(entry: DrafterEntry) -> dict[str, Any]:
    """Suffix decoding drafts from the request's own tokens only: the bench repeats its prompts, and the global
    tree of earlier outputs would replay the earlier repeats' continuations."""
    return {"suffix_global_tokens": 0} if entry.name == "suffix" else {}


def _spec_engines(a: argparse.Namespace, target: Path, draft: Path | None, opts: dict[str, Any]) -> dict[str, Engine]:
    """The plain engine and one per drafter mode the pair and the heads given allow."""
    engines: dict[str, Engine] = {"plain": Engine.from_pretrained(target, **opts)}
    heads = _heads(a)
    for mode, entry in SPEC_MODES.items():
        runs, arg = _draft_arg(entry, draft, heads)
        if runs:
            spec = SpeculationConfig(drafter=entry.name, k=a.k, k_policy=a.k_policy, **_own_only(entry))
            try:
                engines[mode] = Engine.from_pretrained(target, arg, speculation=spec, **opts)
            except SuffixDecodingUnavailableError as e:  # an optional extra this machine lacks: no such mode
                log.warning("mode %s not run: %s", mode, e)
    return engines


def _lookup_engines(
    a: argparse.Namespace, target: Path, draft: Path | None, opts: dict[str, Any], engines: dict[str, Engine]
) -> dict[str, str]:
    """Adds to ``engines`` a <mode>+lookup mode per drafter mode that lookup may wrap (with --prompt-lookup):
    prompt lookup first, then the mode's drafter; returns {lookup mode: its base mode}."""
    heads = _heads(a)
    lookup_modes = {}
    for mode, entry in SPEC_MODES.items():
        if a.prompt_lookup is None or not entry.lookup_first or mode not in engines:
            continue
        spec = SpeculationConfig(
            drafter=entry.name, k=a.k, k_policy=a.k_policy, prompt_lookup_min=a.prompt_lookup, costs=engines[mode].costs
        )
        lookup_modes[f"{mode}+lookup"] = mode
        engines[f"{mode}+lookup"] = Engine.from_pretrained(
            target, _draft_arg(entry, draft, heads)[1], speculation=spec, **opts
        )
    trees = [m for m, e in SPEC_MODES.items() if e.trees]
    tree_modes = trees + [f"{m}+lookup" for m in trees if f"{m}+lookup" in engines]
    for mode in tree_modes:  # trees beside chains
        base = mode.removesuffix("+lookup")
        if a.tree_branches is None or mode not in engines:
            continue
        entry = SPEC_MODES[base]
        lookup = a.prompt_lookup if mode != base else None
        spec = SpeculationConfig(
            drafter=entry.name,
            k=a.k,
            k_policy=a.k_policy,
            prompt_lookup_min=lookup,
            tree_branches=a.tree_branches,
            **_own_only(entry),
        )
        arg = _draft_arg(entry, draft, heads)[1]
        engines[f"{mode}+tree"] = Engine.from_pretrained(target, arg, speculation=spec, **opts)
        lookup_modes[f"{mode}+tree"] = base
    return lookup_modes


def _engines(a: argparse.Namespace, target: Path, draft: Path | None, sweep: list[int]) -> _Modes:
    """Every specmix mode's engine, in the order the table lists them."""
    # batch 1 (the prompts run one after another): one cache row each, not max_batch rows per engine
    opts = {"dtype": a.dtype, "kernels": KernelOptions(attention=a.attention), "limits": Limits(max_batch=1)}
    engines = _spec_engines(a, target, draft, opts)
    lookup_modes = _lookup_engines(a, target, draft, opts, engines)
    model_sweep = sweep if "specmix-model" in engines else []  # no draft model: the heads' sweeps only
    costs = engines["specmix-model"].costs if model_sweep else None  # measured once, shared by the sweep
    sweep_modes = {f"specmix-model-k{k}": k for k in model_sweep}
    for mode, k in sweep_modes.items():
        engines[mode] = Engine.from_pretrained(
            target, draft, speculation=SpeculationConfig(k=k, k_policy="constant", costs=costs), **opts
        )
    head_sweep: dict[str, int] = {}  # fixed K for the heads: kept out of the draft model's sweep summary
    for kind, head_dir in _heads(a).items():
        for k in sweep if head_dir is not None else []:
            head_sweep[f"specmix-{kind}-k{k}"] = k
            spec = SpeculationConfig(drafter=kind, k=k, k_policy="constant", costs=engines[f"specmix-{kind}"].costs)
            engines[f"specmix-{kind}-k{k}"] = Engine.from_pretrained(target, head_dir, speculation=spec, **opts)
    return _Modes(engines, lookup_modes, sweep_modes, head_sweep, costs)


def _runs(
    a: argparse.Namespace, modes: _Modes, target: Path, draft: Path | None, prompts: list[Prompt], split: Split | None
) -> _Runs:
    """The runners of the specmix modes, then of the transformers modes (unless --no-hf or it is missing),
    cut to --modes (plain, the sweeps and the lookup modes of the modes kept stay). With a workload's
    ``split``, each runner runs the categories one after another, recording each."""
    engines, n = modes.engines, a.max_new_tokens
    sinks: dict[str, list[dict[str, Any]]] = {m: [] for m in engines if m != "plain"}
    outputs: dict[str, list[list[int]]] = {m: [] for m in engines}
    runners: dict[str, Callable[[], tuple[int, float]]] = {
        m: spec_runner(e, prompts, n, sinks.get(m), outputs[m])
        if split is None
        else split.spec(m, e, n, sinks.get(m), outputs[m])
        for m, e in engines.items()
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
            groups = [prompts] if split is None else list(split.prompts.values())
            hf, hf_counts[mode] = hf_runners(target, draft, groups, n, mode, a.k, getattr(torch, a.dtype))
            runners[mode] = hf[0] if split is None else split.joined(mode, dict(zip(split.prompts, hf)))
    if a.modes:
        keep = set(a.modes.split(",")) | {"plain"} | set(modes.sweep) | set(modes.head_sweep)
        keep |= {m for m, base in modes.lookup.items() if base in keep}
        runners = {m: r for m, r in runners.items() if m in keep}
    return _Runs(runners, sinks, outputs, hf_counts)


def _measure(a: argparse.Namespace, modes: _Modes, runs: _Runs) -> dict[str, list[float]]:
    """Tokens/s of every mode per repeat: one warm-up round (its stats dropped), then --repeats rounds,
    the modes interleaved within each."""
    for r in runs.runners.values():  # warm-up
        r()
    for e in modes.engines.values():
        e.reset_stats()  # count only the measured repeats
    for sink in runs.sinks.values():
        sink.clear()
    for c in runs.hf_counts.values():
        c.update(target=0, draft=0)
    rates: dict[str, list[float]] = {m: [] for m in runs.runners}
    for _ in tqdm(range(a.repeats), desc="repeats"):
        for m, r in runs.runners.items():
            toks, secs = r()
            rates[m].append(toks / secs)
    return rates


def _spec_figures(eng: Engine) -> dict[str, Any]:
    """A drafter mode's acceptance, its per-token acceptance, its measured costs and, where its rows drafted, the
    cost model's predicted speedup at the K it would choose."""
    st = eng.stats()
    row: dict[str, Any] = {"acceptance_rate": st["acceptance_rate"], "mean_accepted_length": st["mean_accepted_length"]}
    row["token_acceptance"] = acc = st["token_acceptance"]  # the cost model's a (accepted / drafted is biased low)
    if eng.costs is None:
        return row
    row["costs"] = eng.costs.to_dict()  # measured whether or not its rounds drafted (the tuner may run plain)
    if acc is not None:
        k = best_k(min(acc, 0.999), eng.costs, 1, eng.policy.k_max)
        row["predicted_speedup"] = expected_speedup(acc, k, eng.costs)
    return row


def _row(
    m: str, rates: dict[str, list[float]], modes: _Modes, runs: _Runs, reference: list[list[int]]
) -> dict[str, Any]:
    """The table's row of mode ``m``: tokens/s and speedup (medians), output match, acceptance."""
    tps = statistics.median(rates[m])
    row: dict[str, Any] = {
        "name": m,
        "tokens_per_s": tps,
        "speedup_vs_plain": tps / statistics.median(rates["plain"]),
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "predicted_speedup": None,
        "repeats": rates[m],
        "fixed_k": modes.sweep.get(m, modes.head_sweep.get(m)),
    }
    if m in runs.outputs:  # spec vs the target alone in this dtype (1.0 in float32), and vs the float32 target
        row["match_vs_plain"] = match_rate(runs.outputs[m], runs.outputs["plain"])
        row["match_vs_float32"] = match_rate(runs.outputs[m], reference)
    if m in runs.sinks:
        pos = aggregate_positions(runs.sinks[m])
        row["per_position_acceptance"], row["per_position_requests"] = pos["acceptance"], pos["requests"]
    if m in modes.sweep or m in modes.head_sweep:
        st = modes.engines[m].stats()
        row["acceptance_rate"], row["mean_accepted_length"] = st["acceptance_rate"], st["mean_accepted_length"]
    if (m in SPEC_MODES or m in modes.lookup) and m in modes.engines:
        row.update(_spec_figures(modes.engines[m]))
    if m in runs.hf_counts and m != "hf-plain":
        c = runs.hf_counts[m]
        row["draft_forwards_per_target_forward"] = c["draft"] / max(1, c["target"])
    return row


def _settings(
    a: argparse.Namespace, modes: _Modes, prompts: list[Prompt], sweep: list[int], split: Split | None
) -> dict[str, Any]:
    """The result's settings: the run's options and the kernels the engines chose (the prompts' text, or the
    workload's file and prompts per category)."""
    spec_info = modes.engines["specmix-model"].info if "specmix-model" in modes.engines else {}  # the draft model's
    plain = modes.engines["plain"].info
    return {
        "max_new_tokens": a.max_new_tokens,
        "repeats": a.repeats,
        "k": a.k,
        "k_policy": a.k_policy,
        "prompts": prompts if split is None else None,
        "workload": None if split is None else {"file": str(a.workload), "categories": split.counts()},
        "threads": torch.get_num_threads(),
        "greedy": True,
        "dtype": a.dtype,
        "draft_dtype": spec_info.get("draft_dtype"),
        "attention": plain["attention"],
        "cpu_linear_kernel": plain.get("cpu_linear_kernel"),
        "cpu_decode_step": spec_info.get("cpu_decode_step"),
        **{
            k: spec_info.get(k)
            for k in (
                "target_step_weights",
                "target_step_amx",
                "target_step_int8_amx",
                "draft_step_weights",
                "draft_step_amx",
            )
        },
        "batch": 1,
        "sweep_k": sweep,
    }


def _workload(a: argparse.Namespace) -> list[WorkloadItem] | None:
    """--workload's prompts, checked before any model loads; None without it."""
    if a.workload is None:
        return None
    if a.prompts is not None:
        raise InvalidConfigError("--workload and --prompts are exclusive: give one prompt source")
    if a.target is None:
        raise InvalidConfigError("--workload needs --target with a chat template (the demo pair has none)")
    items = load_workload(a.workload)
    check_template(a.target)
    return items


def bench(a: argparse.Namespace) -> int:
    sweep = parse_sweep(a)
    if a.plot is not None:
        require_matplotlib("--plot")  # before any benchmarking
    items = _workload(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    target, draft, root = _pair(a)
    modes = _engines(a, target, draft, sweep)
    split = None if items is None else Split.render(modes.engines["plain"], items)
    prompts: list[Prompt] = load_prompts(a, root) if split is None else list(split.flat())
    runs = _runs(a, modes, target, draft, prompts, split)
    rates = _measure(a, modes, runs)
    reference = runs.outputs["plain"]  # greedy outputs of the target alone, in --dtype
    if a.dtype != "float32":  # ... and of the float32 target, which the reduced precision is measured against
        reference = []
        spec_runner(Engine.from_pretrained(target), prompts, a.max_new_tokens, outputs=reference)()
    rows = [_row(m, rates, modes, runs, reference) for m in runs.runners]
    sweep_result = sweep_summary(rows, modes.sweep, runs.sinks, modes.costs)
    print_table(rows)
    result = {
        "modes": rows,
        "pair": {"target": str(target), "draft": None if draft is None else str(draft)},
        "settings": _settings(a, modes, prompts, sweep, split),
        "sweep": sweep_result,
    }
    if split is not None:  # the same modes per category: each category's prompts within the same runs
        result["categories"] = split.rows(list(runs.runners))
        print_categories(result["categories"])
    from engine.core.files import write_bytes_atomic, write_json_atomic

    if a.json:
        write_json_atomic(a.json, result)
    if a.plot is not None:
        write_bytes_atomic(a.plot, draw_bench(bench_series(result)))
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

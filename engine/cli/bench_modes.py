"""The measuring parts of tools/bench.py: a runner per mode (specmix engines, transformers' generate with
and without an assistant model), the greedy match rate against reference outputs, the fixed-K sweep's
summary with the cost model's prediction, and the printed table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine import Engine, SamplingParams
from engine.build.plots import aggregate_positions
from engine.spec_decode.adaptive import Costs, expected_speedup

Prompt = str | list[int]  # text (encoded by the engine) or token ids (e.g. a chat template's rendering)


def spec_runner(
    eng: Engine,
    prompts: Sequence[Prompt],
    n: int,
    sink: list[dict[str, Any]] | None = None,
    outputs: list[list[int]] | None = None,
) -> Callable[[], tuple[int, float]]:
    """Generate every prompt once; each Completion's stats go to ``sink`` and the token ids of the latest
    run to ``outputs`` (when given)."""
    sp = SamplingParams(max_new_tokens=n)

    def run() -> tuple[int, float]:
        t0, toks, ids = time.perf_counter(), 0, []
        for p in prompts:
            out = eng.generate([p], sp)[0]
            toks += len(out.token_ids)
            ids.append(out.token_ids)
            if sink is not None:
                sink.append(out.stats)
        secs = time.perf_counter() - t0
        if outputs is not None:
            outputs[:] = ids
        return toks, secs

    return run


def match_rate(outs: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    """Greedy agreement of outputs with reference outputs of the same prompts: the share of prompts whose
    output is identical, and the mean share of each reference output that the output reproduces before
    its first differing token (after one flip the continuations diverge, so later tokens say nothing)."""
    if len(outs) != len(ref) or not ref:
        raise ValueError("match_rate needs one output per reference output")
    prefix = []
    for o, r in zip(outs, ref):
        same = next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), min(len(o), len(r)))
        prefix.append(same / max(1, len(r)))
    return {"identical": sum(o == r for o, r in zip(outs, ref)) / len(ref), "prefix": statistics.fmean(prefix)}


def hf_runner(
    target: Path,
    draft: Path | None,
    prompts: Sequence[Prompt],
    n: int,
    mode: str,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[Callable[[], tuple[int, float]], dict[str, int]]:
    """transformers' generate over ``prompts`` (greedy, exactly n new tokens): the runner and its forward counts."""
    runners, counts = hf_runners(target, draft, [prompts], n, mode, k, dtype)
    return runners[0], counts


def hf_runners(
    target: Path,
    draft: Path | None,
    groups: Sequence[Sequence[Prompt]],
    n: int,
    mode: str,
    k: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[Callable[[], tuple[int, float]]], dict[str, int]]:
    """One runner per group of prompts on one loaded model (and assistant), and their shared forward counts."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    tok = tf.PreTrainedTokenizerFast(tokenizer_file=str(target / "tokenizer.json"))
    kw: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
    counts = {"target": 0, "draft": 0}
    model.register_forward_hook(lambda *_: counts.__setitem__("target", counts["target"] + 1))
    if mode != "hf-plain":
        assistant = tf.AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
        if mode == "hf-assisted-k5":  # transformers 5 reads these from the assistant's generation_config
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
        assistant.register_forward_hook(lambda *_: counts.__setitem__("draft", counts["draft"] + 1))
        kw["assistant_model"] = assistant

    def encode(p: Prompt) -> torch.Tensor:
        return tok(p, return_tensors="pt").input_ids if isinstance(p, str) else torch.tensor([p], dtype=torch.long)

    def runner(ids: list[torch.Tensor]) -> Callable[[], tuple[int, float]]:
        def run() -> tuple[int, float]:
            t0, toks = time.perf_counter(), 0
            with torch.no_grad():
                for x in ids:
                    out = model.generate(x, attention_mask=torch.ones_like(x), **kw)
                    toks += out.shape[1] - x.shape[1]
            return toks, time.perf_counter() - t0

        return run

    return [runner([encode(p) for p in g]) for g in groups], counts


def sweep_summary(
    modes: list[dict[str, Any]],
    sweep_modes: dict[str, int],
    sinks: dict[str, list[dict[str, Any]]],
    costs: Costs | None,
) -> dict[str, Any] | None:
    """The fixed-K runs with the cost model's prediction: one acceptance a for all K (the cost model
    takes a as a property of the pair), estimated as the first draft position's acceptance over the
    sweep's requests (unbiased under the model's i.i.d. acceptance; accepted/drafted is not for K > 1)."""
    if not sweep_modes or costs is None:
        return None
    rows = {m["name"]: m for m in modes if m["name"] in sweep_modes}
    first = aggregate_positions(st for m in rows for st in sinks[m])["acceptance"]
    acc = first[0] if first else None
    runs = []
    for name, row in rows.items():
        k = sweep_modes[name]
        row["predicted_speedup"] = None if acc is None else expected_speedup(acc, k, costs)
        runs.append(
            {
                "k": k,
                "mode": name,
                **{
                    f: row[f]
                    for f in (
                        "tokens_per_s",
                        "speedup_vs_plain",
                        "acceptance_rate",
                        "mean_accepted_length",
                        "predicted_speedup",
                    )
                },
            }
        )
    return {
        "drafter": "model",
        "adaptive_k": False,
        "acceptance": acc,
        "acceptance_estimate": "first draft position, mean over the sweep's requests",
        "costs": costs.to_dict(),
        "runs": sorted(runs, key=lambda r: r["k"]),
    }


def print_table(modes: list[dict[str, Any]]) -> None:
    fmt = lambda x, f: "-" if x is None else format(x, f)
    rows = [("mode", "tok/s", "x plain", "accept", "mean len", "predicted", "same as plain", "same as fp32")]
    for m in modes:
        same = [None if m.get(f) is None else m[f]["identical"] for f in ("match_vs_plain", "match_vs_float32")]
        rows.append(
            (
                m["name"],
                fmt(m["tokens_per_s"], ".1f"),
                fmt(m["speedup_vs_plain"], ".2f"),
                fmt(m["acceptance_rate"], ".3f"),
                fmt(m["mean_accepted_length"], ".2f"),
                fmt(m["predicted_speedup"], ".2f"),
                fmt(same[0], ".0%"),
                fmt(same[1], ".0%"),
            )
        )
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(x) for c, x in zip(r, w)))

"""Calibrating speculation for a profile: acceptance with the planned (FP8) draft and
with the unquantized draft, cost ratios on the device at hand, and K with its bounds."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine.api.engine import Engine
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.adaptive import Costs, best_k, expected_speedup
from engine.spec_decode.sampling import SamplingParams


def calib_prompts(tok: Tokenizer, text: str, n: int = 8, prompt_len: int = 48) -> list[list[int]]:
    """n prompts of prompt_len tokens spread evenly over the calibration text."""
    ids = tok.encode(text)
    span = max(1, (len(ids) - prompt_len) // max(1, n))
    return [ids[i * span : i * span + prompt_len] for i in range(n) if ids[i * span : i * span + prompt_len]]


def acceptance(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Greedy per-token acceptance a of the engine's drafter on the prompts: accepted drafts over
    draft positions tested (a round stops testing at its first rejection), the estimate the cost
    model and the K controller use; accepted / drafted would be biased low for K > 1."""
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    trials = sum(o.stats["draft_trials"] for o in outs)
    return sum(o.stats["accepted"] for o in outs) / trials if trials else 0.0


def k_bounds(a: float, costs: Costs, k_search: int = 8, within: float = 0.9) -> tuple[int, int, int, float]:
    """(best K, k_min, k_max, predicted speedup): the bounds keep >= `within` of the best speedup."""
    k = best_k(min(a, 0.999), costs, 1, k_search)
    best = expected_speedup(a, k, costs)
    good = [j for j in range(1, k_search + 1) if expected_speedup(a, j, costs) >= within * best]
    return k, min(good), max(good), best


def calibrate(
    target_dir: Path,
    draft_dir: Path | None,
    plan: Any,
    calib_text: str,
    *,
    device: str = "cpu",
    k_probe: int = 4,
    k_search: int = 8,
    n_prompts: int = 8,
    max_new_tokens: int = 48,
    drafter: str = "model",
    lookup: int | None = None,
) -> dict[str, Any]:
    """The profile's speculation section: a draft model, a trained head (drafter "medusa" / "eagle": its K is
    capped at its heads) or, with no draft, the n-gram drafter (drafter "ngram", draft_dir None). A draft model, and a
    head the plan quantizes (eagle's FP8 Linears), are also measured unquantized (``acceptance_fp16_draft``).
    ``lookup``: prompt lookup first (``SpeculationConfig.prompt_lookup_min``), measured and kept with it."""
    spec = SpeculationConfig(drafter=drafter, k=k_probe, k_policy="constant", k_max=k_search, prompt_lookup_min=lookup)
    planned = Engine.from_pretrained(
        target_dir, draft_dir, speculation=spec, precision=PrecisionConfig(plan, calib_text), device=device
    )
    prompts = calib_prompts(planned.tokenizer, calib_text, n_prompts)
    a = acceptance(planned, prompts, max_new_tokens)
    fp16_side: dict[str, float] = {}
    quantized_head = plan.draft is not None and any(f.quantized for f in plan.draft.all_plans())
    if drafter == "model" or (drafter in ("medusa", "eagle") and quantized_head):
        fp16 = PrecisionConfig(dataclasses.replace(plan, draft=None), calib_text)
        fp16_draft = Engine.from_pretrained(target_dir, draft_dir, speculation=spec, device=device, precision=fp16)
        fp16_side["acceptance_fp16_draft"] = acceptance(fp16_draft, prompts, max_new_tokens)
    elif drafter in ("medusa", "eagle"):
        fp16_side["acceptance_fp16_draft"] = a  # the head is not quantized (medusa): the same run
    costs = planned.costs
    assert costs is not None and planned.policy is not None
    k, k_min, k_max, speedup = k_bounds(a, costs, min(k_search, planned.policy.k_max))
    chosen = SpeculationConfig(
        drafter=drafter, k=k, k_min=k_min, k_max=k_max, k_policy="cost-model", costs=costs, prompt_lookup_min=lookup
    )
    return {
        **chosen.to_profile(),  # drafter, k, k_min, k_max, policy, c, v: what Engine.from_profile reads back
        "acceptance": a,
        **fp16_side,
        "predicted_speedup": speedup,
        "probe": {"k": k_probe, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "greedy": True},
    }

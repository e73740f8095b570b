"""Calibrating speculation for a profile: acceptance with the planned (FP8) draft and
with the unquantized draft, cost ratios on the device at hand, and K with its bounds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.api.engine import Engine
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.api.profile_sections import Probe, Speculation, SpeculationCalibration
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.adaptive import Costs, best_k, expected_speedup
from engine.spec_decode.registry import Loads
from engine.spec_decode.sampling import SamplingParams
from quant.plan_schema import PrecisionPlan


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


@dataclass(frozen=True)
class ProbeOptions:
    """How ``calibrate`` probes the drafter."""

    k_probe: int = 4
    """The fixed K of the acceptance probe."""
    k_search: int = 8
    """The largest K the choice considers (capped at the drafter's own largest K)."""
    n_prompts: int = 8
    """Prompts taken from the calibration text."""
    max_new_tokens: int = 48
    """New tokens per prompt (greedy)."""


def calibrate(
    target_dir: Path,
    draft_dir: Path | None,
    plan: PrecisionPlan,
    calib_text: str,
    *,
    device: str = "cpu",
    drafter: str = "model",
    lookup: int | None = None,
    probe: ProbeOptions = ProbeOptions(),
) -> Speculation:
    """The profile's speculation section for any drafter of the registry: a draft model, a trained head (its K is
    capped at its heads) or one with no draft (n-gram: draft_dir None). A draft model, and a head the plan
    quantizes (eagle's FP8 Linears), are also measured unquantized (``acceptance_fp16_draft``).
    ``lookup``: prompt lookup first (``SpeculationConfig.prompt_lookup_min``), measured and kept with it."""
    spec = SpeculationConfig(
        drafter=drafter, k=probe.k_probe, k_policy="constant", k_max=probe.k_search, prompt_lookup_min=lookup
    )
    planned = Engine.from_pretrained(
        target_dir, draft_dir, speculation=spec, precision=PrecisionConfig(plan, calib_text), device=device
    )
    prompts = calib_prompts(planned.tokenizer, calib_text, probe.n_prompts)
    a = acceptance(planned, prompts, probe.max_new_tokens)
    a16: float | None = None
    quantized_head = plan.draft is not None and any(f.quantized for f in plan.draft.all_plans())
    loads = spec.registry[drafter].loads
    if loads is Loads.DRAFT_MODEL or (loads is Loads.HEAD and quantized_head):
        fp16 = PrecisionConfig(plan, calib_text).target_only()
        fp16_draft = Engine.from_pretrained(target_dir, draft_dir, speculation=spec, device=device, precision=fp16)
        a16 = acceptance(fp16_draft, prompts, probe.max_new_tokens)
    elif loads is Loads.HEAD:
        a16 = a  # the head is not quantized (medusa): the same run
    costs = planned.costs
    assert costs is not None and planned.policy is not None
    k, k_min, k_max, speedup = k_bounds(a, costs, min(probe.k_search, planned.policy.k_max))
    chosen = SpeculationConfig(
        drafter=drafter, k=k, k_min=k_min, k_max=k_max, k_policy="measured", costs=costs, prompt_lookup_min=lookup
    )
    measured = SpeculationCalibration(
        acceptance=a,
        acceptance_fp16_draft=a16,
        predicted_speedup=speedup,
        probe=Probe(k=probe.k_probe, prompts=len(prompts), max_new_tokens=probe.max_new_tokens, greedy=True),
    )
    return Speculation(chosen, measured)  # what Engine.from_profile reads back

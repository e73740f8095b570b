"""The build's throughput check: the planned models against the unquantized ones on the build's device.

Four engines, one after another (one held at a time, as a GPU's memory allows): the unquantized target
alone, the planned target alone, and both with the calibrated speculation (the unquantized draft, the
planned draft). Each decodes the same calibration prompts greedily at batch 1 after one warm-up prompt;
its tokens/s is the median over rounds, and its weight bytes are what ``Engine.stats()["memory"]`` says is
resident after decoding (as allocated: the kernels' copies included). The outputs are token-identical
(greedy and lossless), so the four runs decode the same tokens.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.api.engine import Engine
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.api.profile_sections import DecodeRun, Throughput
from engine.build.calibrate import calib_prompts
from engine.spec_decode.sampling import SamplingParams
from quant.plan_schema import PrecisionPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThroughputOptions:
    """How the throughput check decodes."""

    prompts: int = 3
    """Prompts taken from the calibration text."""
    max_new_tokens: int = 32
    """New tokens per prompt."""
    rounds: int = 3
    """Timed passes over the prompts per engine (the median is kept)."""


def decode_run(engine: Engine, prompts: list[list[int]], opts: ThroughputOptions) -> DecodeRun:
    """One engine's median tokens/s over ``opts.rounds`` passes (batch 1) and its resident weight bytes."""
    sp = SamplingParams(max_new_tokens=opts.max_new_tokens)
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=4))  # warm-up: lazy kernels, first allocations
    rates = []
    for _ in range(opts.rounds):
        t0, n = time.perf_counter(), 0
        for p in prompts:
            n += len(engine.generate([p], sp)[0].token_ids)
        rates.append(n / (time.perf_counter() - t0))
    mem = engine.stats()["memory"]
    return DecodeRun(statistics.median(rates), int(mem["target_weight_bytes"] + mem.get("draft_weight_bytes", 0)))


def measure_throughput(
    target_dir: Path,
    draft_dir: Path | None,
    plan: PrecisionPlan,
    calib_text: str,
    spec: SpeculationConfig,
    *,
    device: str = "cpu",
    opts: ThroughputOptions = ThroughputOptions(),
) -> Throughput:
    """The profile's ``throughput`` section (see the module doc)."""
    planned = PrecisionConfig(plan, calib_text)
    alone = planned.target_only()
    makers: dict[str, Callable[[], Engine]] = {
        "unquantized_plain": lambda: Engine.from_pretrained(target_dir, device=device),
        "planned_plain": lambda: Engine.from_pretrained(target_dir, device=device, precision=alone),
        "unquantized_speculative": lambda: Engine.from_pretrained(
            target_dir, draft_dir, speculation=spec, device=device
        ),
        "planned_speculative": lambda: Engine.from_pretrained(
            target_dir, draft_dir, speculation=spec, device=device, precision=planned
        ),
    }
    runs: dict[str, DecodeRun] = {}
    prompts: list[list[int]] = []
    for name, make in makers.items():
        engine = make()
        prompts = prompts or calib_prompts(engine.tokenizer, calib_text, opts.prompts)
        runs[name] = decode_run(engine, prompts, opts)
        log.info("throughput: %s %.1f tokens/s", name, runs[name].tokens_per_s)
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return Throughput(**runs, prompts=len(prompts), max_new_tokens=opts.max_new_tokens, rounds=opts.rounds)

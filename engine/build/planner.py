"""The build's planner step: search the target's per-layer FFN plan on the calibration text.

quant.search does the work on a loaded model; this loads the target as the engine will
(fp32 on the CPU, the engine's dtype on CUDA), feeds it the calibration windows that
SmoothQuant's statistics come from at load (engine.plan_apply.calib_batches, so the searched
alphas and the loaded engine's smoothing factors see the same absmax), and returns the plan
with the chosen per-layer modules. The eval text never comes here.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from engine.api.plan_apply import calib_batches
from engine.core.checkpoint import load_model
from engine.core.config import load_config
from engine.core.model import Transformer
from engine.core.tokenizer import Tokenizer
from engine.kernels.cost_meter import ModuleCostMeter
from engine.kernels.cpu_gemm import small_gemm_status
from engine.kernels.cpu_int8 import CpuCostMeter
from engine.kernels.step_weights import dense_step_storage
from quant.candidates import CostFn

log = logging.getLogger(__name__)

# The search's bounds on the calibration text: margins under the eval text's aims (KLD <= 0.0015,
# top-1 >= 0.98). On SmolLM2-135M the eval KLD of a plan ran 1.1-1.2x its calibration KLD.
DEFAULT_KLD_BUDGET = 8e-4
DEFAULT_MIN_TOP1 = 0.98
KLD_WINDOWS = 16  # of calib_batches' 256-token windows: 4,096 calibration tokens score each candidate plan


def measured_costs(device: str, model: Transformer | None = None) -> tuple[CostFn | None, str | None]:
    """The plan runs where it is built: its candidates' costs measured there (the CPU's C++ step kernels, the
    dense Linear as the step would hold ``model``'s, fp32 without one; on CUDA each candidate's Linear), and how
    the profile names them; (None, None) where the CPU kernels are missing (the costs are then on paper)."""
    if device == "cuda":
        meter = ModuleCostMeter(torch.device("cuda"))
        return meter, f"measured on {torch.cuda.get_device_name()} at {meter.rows} rows"
    if small_gemm_status() is None:
        cpu = CpuCostMeter(dense="fp32" if model is None else dense_step_storage(model))
        return cpu, f"measured on this CPU at {cpu.rows} rows, the dense Linear in {cpu.dense}"
    return None, None


def search_plan(
    target_dir: Path,
    plan: Any,
    calib_text: str,
    gpu: dict[str, Any],
    *,
    device: str = "cpu",
    kld_budget: float = DEFAULT_KLD_BUDGET,
    min_top1: float = DEFAULT_MIN_TOP1,
    draft_dir: Path | None = None,
) -> tuple[Any, dict[str, Any]]:
    """(the plan with the searched target FFN, the search record for the profile)."""
    from quant.apply import store_narrow
    from quant.calibration import collect_calibration
    from quant.plan import with_target_choices
    from quant.search import search_ffn

    dtype = torch.float32 if device == "cpu" else torch.float16
    model = load_model(target_dir, dtype, device)
    tok = Tokenizer(target_dir)
    calib = collect_calibration(model, calib_batches(tok, calib_text), kld_windows=KLD_WINDOWS)
    store_narrow(model, plan.target)  # the trials' KLD is the plan's: its 16-bit attention included
    cost, source = measured_costs(device, model)
    res = search_ffn(
        model, calib, gpu, kld_budget=kld_budget, min_top1=min_top1, dense_storage=plan.target.compute_dtype,
        cost=cost, cost_source=source,
    )  # fmt: skip
    note = (
        f"planner: per-layer FFN choices {res.counts} (calibration KLD {res.kld:.5f} <= {kld_budget}, "
        f"top-1 {res.top1:.4f}; plan.target.modules says why for each)"
    )
    tcfg = load_config(target_dir)
    dcfg = load_config(draft_dir) if draft_dir is not None else None
    new = with_target_choices(plan, res.family, res.modules, tcfg, dcfg, note)
    record = {
        "kld_budget": kld_budget,
        "min_top1": min_top1,
        "calibration_tokens": sum(w.numel() for w in calib.windows),
        "threshold": res.threshold if math.isfinite(res.threshold) else None,
        "fp16_modules": res.fp16_modules,
        "kld": res.kld,
        "top1": res.top1,
        "counts": res.counts,
        "costs": source or f"on paper on {gpu.get('name')}",
        "trials": res.trials,
    }
    log.info("%s", note)
    return new, record

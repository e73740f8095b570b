"""specmix quantization: FP8 / INT8 primitives, quantized modules, kernels, the GPU catalog and the precision planner.

    from quant import lookup_gpu, make_plan, apply_plan, collect_activation_stats
    plan = make_plan(lookup_gpu("a100"), target.config, draft.config, device="cpu")
    apply_plan(target, plan.target, calib=collect_activation_stats(target, calib_batches))
    apply_plan(draft, plan.draft)

bitsandbytes and transformer-engine are imported only when their kernel runs.
"""

from .apply import apply_plan, collect_activation_stats, model_weight_bytes
from .catalog import known_gpus, load_catalog, lookup_gpu
from .linear import FP8Embedding, FP8Linear, Int8Linear
from .matmul_kernels import KERNELS, kernel_available, require_kernel
from .memory import PlanDoesNotFitError
from .plan import make_plan
from .plan_schema import DEFAULT_PRECISION, ModelPlan, PrecisionPlan

__all__ = [
    "DEFAULT_PRECISION",
    "FP8Embedding",
    "FP8Linear",
    "Int8Linear",
    "KERNELS",
    "ModelPlan",
    "PlanDoesNotFitError",
    "PrecisionPlan",
    "apply_plan",
    "collect_activation_stats",
    "kernel_available",
    "known_gpus",
    "load_catalog",
    "lookup_gpu",
    "make_plan",
    "model_weight_bytes",
    "require_kernel",
]

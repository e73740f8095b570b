"""Writing a profile: the ``Profile`` (engine/api/profile.py) a build makes from what it was given
and what it measured, and the files it writes (the profile's JSON, its build report and plot)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import engine
from engine.api.profile import PROFILE_SCHEMA_VERSION, Profile, Versions, model_ref, weight_hashes
from engine.api.profile_quality import GateAttempt, Quality, QualityFigures, QualityGates
from engine.api.profile_sections import (
    CalibrationText,
    Memory,
    ModelRecord,
    Models,
    Speculation,
    Throughput,
    WeightBytes,
)
from engine.api.runtime import RuntimeSettings
from engine.build.report import build_report_files
from engine.core.config import load_config
from engine.core.files import write_bytes_atomic, write_json_atomic
from engine.spec_decode.heads.config import is_head_dir, read_head_config
from quant.plan_schema import PrecisionPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileInputs:
    """What a build is given: the profile's name, GPU and device, its models and texts, and the gate's bounds."""

    name: str
    """The profile's name (``<gpu>-<model>`` or the output file's stem)."""
    gpu: dict[str, Any]
    """The GPU's catalog entry (quant/gpus.json)."""
    device: str
    """"cuda" or "cpu": where the gate and the calibration run."""
    target: Path
    """The target checkpoint directory."""
    draft: Path | None
    """The draft checkpoint or trained head directory; None: the n-gram drafter."""
    eval_path: Path
    """The eval text's file."""
    eval_text: str
    """The eval text (the quality gate's)."""
    calib_path: Path
    """The calibration text's file."""
    calib_text: str
    """The calibration text (SmoothQuant, the planner's search, the speculation probe); never the eval text."""
    gates: QualityGates
    """The gate's bounds."""
    max_eval_tokens: int | None = None
    """The cap on eval tokens; None: all of the text."""
    demo: tuple[str, Path] | None = None
    """(size, pair directory) when the models are a demo pair: they and its texts are named ``demo:...``."""


@dataclass(frozen=True)
class PassedGate:
    """The quality gate's outcome when a plan passed."""

    plan: PrecisionPlan
    """The passing plan."""
    figures: QualityFigures
    """Its figures."""
    attempts: tuple[GateAttempt, ...]
    """Every plan tried, the passing one last."""


def model_config(model_dir: Path) -> dict[str, Any]:
    """A checkpoint's ModelConfig, or a trained head's config (engine/spec_decode/heads/config.py)."""
    if is_head_dir(model_dir):
        return dataclasses.asdict(read_head_config(model_dir))
    return load_config(model_dir).to_dict()


def model_record(model_dir: Path, demo: tuple[str, Path] | None = None) -> ModelRecord:
    return ModelRecord(model_ref(model_dir, demo), weight_hashes(model_dir), model_config(model_dir))


def validated_on(device: str) -> str:
    """The CUDA device's name, or ``cpu: <processor>``."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu: {platform.processor() or platform.machine()}"


def plan_memory(plan: PrecisionPlan, with_draft: bool) -> Memory:
    m = plan.memory
    return Memory(
        target=WeightBytes(m.target_weight_bytes, m.target_fp16_bytes),
        draft=WeightBytes(m.draft_weight_bytes, m.draft_fp16_bytes) if with_draft else None,
        kv_cache_bytes=m.kv_cache_bytes,
        budget_bytes=m.budget_bytes,
        max_batch=m.max_batch,
        max_seq_len=m.max_seq_len,
    )


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_profile(
    inp: ProfileInputs, gate: PassedGate, speculation: Speculation, throughput: Throughput | None = None
) -> Profile:
    """The profile of a build whose plan passed the gate and whose speculation was calibrated (and, where measured,
    whose models' decoding was timed against the unquantized ones)."""
    ref = lambda p: model_ref(p, inp.demo)  # noqa: E731
    return Profile(
        name=inp.name,
        gpu=dict(inp.gpu),
        validated_on=validated_on(inp.device),
        device=inp.device,
        models=Models(
            model_record(inp.target, inp.demo), None if inp.draft is None else model_record(inp.draft, inp.demo)
        ),
        precision=gate.plan.precision,
        plan=gate.plan,
        memory=plan_memory(gate.plan, inp.draft is not None),
        quality=Quality(
            figures=gate.figures,
            max_tokens=inp.max_eval_tokens,
            eval_text=ref(inp.eval_path),
            eval_text_sha256=_sha256(inp.eval_text),
            gates=inp.gates,
            attempts=gate.attempts,
        ),
        calibration=CalibrationText(ref(inp.calib_path), _sha256(inp.calib_text)),
        speculation=speculation,
        # how the engine runs the plan: CUDA graphs where the profile's device is a GPU (never on the
        # CPU), and the load-aware window (lower K and the batch above this GPU memory use)
        runtime=RuntimeSettings(cuda_graphs=inp.device == "cuda", load_window=True),
        throughput=throughput,
        versions=Versions(torch=torch.__version__, specmix=engine.__version__),
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        schema_version=PROFILE_SCHEMA_VERSION,
    )


def write_profile(profile: Profile, path: Path) -> list[Path]:
    """Write ``profile.to_dict()`` to ``path`` atomically, then its build report (.md) and plot (.png) beside
    it; the report is rendered before anything is written. A stale plot of an older build is removed when this
    build has none. Returns the report files written."""
    report = build_report_files(profile, path)
    write_json_atomic(path, profile.to_dict())
    for p, data in report.items():
        if data is not None:
            write_bytes_atomic(p, data)
        elif p.exists():  # a plot of an older build would not match this profile
            log.info("removing the stale plot %s (this build has none)", p)
            p.unlink()
    return [p for p, data in report.items() if data is not None]

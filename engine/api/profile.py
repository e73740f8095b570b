"""Profiles: the JSON a build writes and a service loads (``Engine.from_profile``).

A profile names its models (demo pairs as ``demo:<pair directory>/<role>``, other models by
path), the sha256 of every weight file, the precision section and plan, the
quality gate's figures, the speculation settings, and versions. ``Profile`` is its one typed
form: the build makes one and writes ``Profile.to_dict()``, a service reads the file back with
``Profile.from_dict`` (through ``load_profile``), so what is written and what is read are the same
code. Loading checks all of it and refuses, with a ProfileError naming the file and the field, a
profile that does not match the schema, the machine or the weights on disk.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch

from engine.api.options import KernelOptions, Limits, PrecisionConfig, SpeculationConfig
from engine.api.runtime import RuntimeSettings, parse_runtime, runtime_options, runtime_settings
from engine.core.checkpoint import weight_files
from engine.core.errors import InvalidConfigError, ProfileError
from engine.core.files import default_cache_dir, sha256_file, verified_sha256
from quant.plan_io import plan_from_dict
from quant.plan_schema import PrecisionPlan, validate_precision

PROFILE_SCHEMA_VERSION = 1
REQUIRED = (
    "schema_version",
    "gpu",
    "validated_on",
    "device",
    "models",
    "precision",
    "plan",
    "memory",
    "quality",
    "speculation",
    "calibration",
    "versions",
    "created_at",
)
SPECULATION_REQUIRED = ("drafter", "k", "k_min", "k_max", "policy")
DEVICES = ("cuda", "cpu")
DEMO_PREFIX = "demo:"


# ---------------------------------------------------------------------------- reading JSON by field
class _Fields:
    """One JSON object of a profile: each read checks the field's type, and every refusal is a
    ProfileError naming the file (``where``) and the field by its dotted path."""

    def __init__(self, value: Any, path: str, where: str) -> None:
        if not isinstance(value, dict):
            raise ProfileError(f"{where}: field {path}={value!r:.80} is invalid: allowed a JSON object")
        self.d, self.path, self.where = value, path, where

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def refuse(self, key: str, value: Any, allowed: str) -> NoReturn:
        raise ProfileError(f"{self.where}: field {self.name(key)}={value!r:.80} is invalid: allowed {allowed}")

    def raw(self, key: str) -> Any:
        if key not in self.d:
            raise ProfileError(f"{self.where}: field {self.name(key)} is missing")
        return self.d[key]

    def absent(self, key: str) -> bool:
        """The field is missing or null (an optional field then reads as None)."""
        return self.d.get(key) is None

    def integer(self, key: str) -> int:
        v = self.raw(key)
        if not isinstance(v, int) or isinstance(v, bool):
            self.refuse(key, v, "an int")
        return v

    def number(self, key: str) -> float:
        v = self.raw(key)
        if not _is_number(v):
            self.refuse(key, v, "a number")
        return float(v)

    def string(self, key: str) -> str:
        v = self.raw(key)
        if not isinstance(v, str):
            self.refuse(key, v, "a string")
        return v

    def flag(self, key: str) -> bool:
        v = self.raw(key)
        if not isinstance(v, bool):
            self.refuse(key, v, "true or false")
        return v

    def array(self, key: str) -> list[Any]:
        v = self.raw(key)
        if not isinstance(v, list):
            self.refuse(key, v, "a JSON array")
        return v

    def mapping(self, key: str) -> dict[str, Any]:
        """A free-form JSON object, copied."""
        v = self.raw(key)
        if not isinstance(v, dict):
            self.refuse(key, v, "a JSON object")
        return copy.deepcopy(v)

    def obj(self, key: str) -> _Fields:
        """A nested object, read field by field."""
        return _Fields(self.raw(key), self.name(key), self.where)

    def opt_integer(self, key: str) -> int | None:
        return None if self.absent(key) else self.integer(key)

    def opt_number(self, key: str) -> float | None:
        return None if self.absent(key) else self.number(key)

    def opt_string(self, key: str) -> str | None:
        return None if self.absent(key) else self.string(key)

    def opt_mapping(self, key: str) -> dict[str, Any] | None:
        return None if self.absent(key) else self.mapping(key)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ModelRecord:
    """One model of a profile (``models.target``, ``models.draft``)."""

    path: str
    """A model reference (``model_ref``): ``demo:<pair directory>/<role>`` for a demo model, else its path."""
    sha256: dict[str, str]
    """The sha256 of each weight file, by file name (checked at load)."""
    config: dict[str, Any]
    """The checkpoint's ModelConfig (``ModelConfig.to_dict``), or a trained head's config."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": dict(self.sha256), "config": copy.deepcopy(self.config)}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "models.target") -> ModelRecord:
        r = _Fields(d, path, where)
        ref, sha, config = r.string("path"), r.mapping("sha256"), r.mapping("config")
        for name, digest in sha.items():
            if not isinstance(digest, str):
                raise ProfileError(f"{where}: field {path}.sha256.{name}={digest!r:.80} is invalid: allowed a string")
        return cls(ref, sha, config)


@dataclass(frozen=True)
class Models:
    """The profile's models (``models``)."""

    target: ModelRecord
    """The target model."""
    draft: ModelRecord | None = None
    """The draft model or trained head; None with the n-gram drafter (no draft)."""

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.to_dict(), "draft": None if self.draft is None else self.draft.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Models:
        r = _Fields(d, "models", where)
        target = ModelRecord.from_dict(r.raw("target"), where, "models.target")
        draft = None if r.absent("draft") else ModelRecord.from_dict(r.d["draft"], where, "models.draft")
        return cls(target, draft)


@dataclass(frozen=True)
class WeightBytes:
    """One model's weights in memory (``memory.target``, ``memory.draft``)."""

    bytes: int
    """Bytes of its weights as planned."""
    fp16_bytes: int
    """Bytes of its weights in FP16."""

    def to_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "fp16_bytes": self.fp16_bytes}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "memory.target") -> WeightBytes:
        r = _Fields(d, path, where)
        return cls(r.integer("bytes"), r.integer("fp16_bytes"))


@dataclass(frozen=True)
class Memory:
    """The plan's memory figures (``memory``)."""

    target: WeightBytes
    """The target's weights."""
    draft: WeightBytes | None
    """The draft's weights; None without a draft."""
    kv_cache_bytes: int
    """Bytes of the KV cache for max_batch x max_seq_len."""
    budget_bytes: int
    """The memory budget on the GPU that weights and KV cache fit."""
    max_batch: int
    """Sequences the KV cache is sized for."""
    max_seq_len: int
    """Longest sequence the KV cache is sized for."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.to_dict(),
            "draft": None if self.draft is None else self.draft.to_dict(),
            "kv_cache_bytes": self.kv_cache_bytes,
            "budget_bytes": self.budget_bytes,
            "max_batch": self.max_batch,
            "max_seq_len": self.max_seq_len,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Memory:
        r = _Fields(d, "memory", where)
        return cls(
            target=WeightBytes.from_dict(r.raw("target"), where, "memory.target"),
            draft=None if r.absent("draft") else WeightBytes.from_dict(r.d["draft"], where, "memory.draft"),
            kv_cache_bytes=r.integer("kv_cache_bytes"),
            budget_bytes=r.integer("budget_bytes"),
            max_batch=r.integer("max_batch"),
            max_seq_len=r.integer("max_seq_len"),
        )


@dataclass(frozen=True)
class QualityFigures:
    """The quality gate's figures of one plan: the planned target against its unquantized self on the same
    windows (engine/build/quality.py's QualityReport)."""

    ppl_ref: float
    """Perplexity of the unquantized reference."""
    ppl: float
    """Perplexity of the planned target."""
    drift: float
    """ppl - ppl_ref (dPPL)."""
    drift_ci95: tuple[float, float]
    """95% confidence interval of the drift."""
    ppl_ref_err: float
    """Standard error of ppl_ref."""
    ppl_err: float
    """Standard error of ppl."""
    kld_mean: float
    """Mean KL divergence, reference -> planned."""
    kld_err: float
    """Standard error of kld_mean."""
    kld_p99: float
    """99th percentile of the per-token KL divergence."""
    top1: float
    """Share of tokens where both models' top-1 agree."""
    top1_err: float
    """Standard error of top1."""
    tokens: int
    """Tokens scored."""
    windows: int
    """Windows evaluated."""
    context: int
    """Tokens per window."""
    method: str
    """Unit of the drift interval: "windows" or "tokens"."""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "drift_ci95": [float(x) for x in self.drift_ci95]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "quality") -> QualityFigures:
        r = _Fields(d, path, where)
        ci = r.array("drift_ci95")
        if len(ci) != 2 or not all(_is_number(x) for x in ci):
            r.refuse("drift_ci95", ci, "two numbers")
        return cls(
            ppl_ref=r.number("ppl_ref"),
            ppl=r.number("ppl"),
            drift=r.number("drift"),
            drift_ci95=(float(ci[0]), float(ci[1])),
            ppl_ref_err=r.number("ppl_ref_err"),
            ppl_err=r.number("ppl_err"),
            kld_mean=r.number("kld_mean"),
            kld_err=r.number("kld_err"),
            kld_p99=r.number("kld_p99"),
            top1=r.number("top1"),
            top1_err=r.number("top1_err"),
            tokens=r.integer("tokens"),
            windows=r.integer("windows"),
            context=r.integer("context"),
            method=r.string("method"),
        )


@dataclass(frozen=True)
class QualityGates:
    """The gate's bounds (``quality.gates``)."""

    max_drift: float
    """Bound on |dPPL|."""
    max_kld: float
    """Bound on the mean KL divergence."""

    def to_dict(self) -> dict[str, Any]:
        return {"max_drift": self.max_drift, "max_kld": self.max_kld}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> QualityGates:
        r = _Fields(d, "quality.gates", where)
        return cls(r.number("max_drift"), r.number("max_kld"))


@dataclass(frozen=True)
class FfnChoice:
    """What a gate attempt's plan chose for the target's FFN (``quality.attempts[i].ffn``)."""

    storage: str
    """Its storage dtype (quant/plan_schema.py STORAGE)."""
    kernel: str
    """Its kernel."""

    def to_dict(self) -> dict[str, Any]:
        return {"storage": self.storage, "kernel": self.kernel}


@dataclass(frozen=True)
class GateAttempt:
    """One plan the build tried (``quality.attempts[i]``), passing or not."""

    plan: str
    """The step of the fallback ladder ("planner: per-layer search", "fp16 FFN", ...)."""
    ffn: FfnChoice
    """The target FFN's storage and kernel in that plan."""
    figures: QualityFigures
    """Its figures on the eval text."""
    passed: bool
    """Whether it passed both gates."""
    search: dict[str, Any] | None = None
    """The planner's search record behind it (engine/build/planner.py), if it searched."""

    def to_dict(self) -> dict[str, Any]:
        out = {"plan": self.plan, "ffn": self.ffn.to_dict(), **self.figures.to_dict(), "passed": self.passed}
        if self.search:
            out["search"] = copy.deepcopy(self.search)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile", path: str = "quality.attempts[0]") -> GateAttempt:
        r = _Fields(d, path, where)
        ffn = r.obj("ffn")
        return cls(
            plan=r.string("plan"),
            ffn=FfnChoice(ffn.string("storage"), ffn.string("kernel")),
            figures=QualityFigures.from_dict(d, where, path),
            passed=r.flag("passed"),
            search=r.opt_mapping("search"),
        )


@dataclass(frozen=True)
class Quality:
    """The quality gate (``quality``): the passing plan's figures, the eval text, the bounds, every attempt."""

    figures: QualityFigures
    """The passing plan's figures (written flat into ``quality``)."""
    max_tokens: int | None
    """The cap on eval tokens; None: all of the text."""
    eval_text: str
    """A reference to the eval text (``model_ref``: ``demo:...`` or its path)."""
    eval_text_sha256: str
    """The eval text's sha256."""
    gates: QualityGates
    """The gate's bounds."""
    attempts: tuple[GateAttempt, ...]
    """Every plan tried, in order; the last passed."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.figures.to_dict(),
            "max_tokens": self.max_tokens,
            "eval_text": self.eval_text,
            "eval_text_sha256": self.eval_text_sha256,
            "gates": self.gates.to_dict(),
            "attempts": [t.to_dict() for t in self.attempts],
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Quality:
        r = _Fields(d, "quality", where)
        return cls(
            figures=QualityFigures.from_dict(d, where, "quality"),
            max_tokens=r.opt_integer("max_tokens"),
            eval_text=r.string("eval_text"),
            eval_text_sha256=r.string("eval_text_sha256"),
            gates=QualityGates.from_dict(r.raw("gates"), where),
            attempts=tuple(
                GateAttempt.from_dict(t, where, f"quality.attempts[{i}]") for i, t in enumerate(r.array("attempts"))
            ),
        )


@dataclass(frozen=True)
class CalibrationText:
    """The calibration text (``calibration``): SmoothQuant's activation statistics and the speculation probe."""

    text: str
    """A reference to it (``model_ref``: ``demo:...`` or its path); never the eval text."""
    sha256: str
    """Its sha256 (checked when the engine loads it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> CalibrationText:
        r = _Fields(d, "calibration", where)
        return cls(r.string("text"), r.string("sha256"))


@dataclass(frozen=True)
class Probe:
    """How the calibration measured acceptance (``speculation.probe``)."""

    k: int
    """The fixed K of the probe."""
    prompts: int
    """Prompts taken from the calibration text."""
    max_new_tokens: int
    """New tokens per prompt."""
    greedy: bool
    """Greedy decoding (else sampled)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SpeculationCalibration:
    """What the calibration measured (the ``speculation`` section's figures beside its settings)."""

    acceptance: float | None = None
    """Per-token acceptance of the drafter as planned (FP8 draft); None: not measured."""
    acceptance_fp16_draft: float | None = None
    """Acceptance with the unquantized draft; None where there is none (the n-gram drafter)."""
    predicted_speedup: float | None = None
    """The cost model's speedup at the chosen K over plain decoding."""
    probe: Probe | None = None
    """How acceptance was measured."""
    per_position_acceptance: tuple[float | None, ...] | None = None
    """Acceptance per draft position (None: a position never tested); None: not measured."""

    def to_dict(self) -> dict[str, Any]:
        ppa = self.per_position_acceptance
        out: dict[str, Any] = {}
        for key, v in (
            ("acceptance", self.acceptance),
            ("acceptance_fp16_draft", self.acceptance_fp16_draft),
            ("predicted_speedup", self.predicted_speedup),
            ("probe", None if self.probe is None else self.probe.to_dict()),
            ("per_position_acceptance", None if ppa is None else list(ppa)),
        ):
            if v is not None:
                out[key] = v
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> SpeculationCalibration:
        r = _Fields(d, "speculation", where)
        probe = None
        if not r.absent("probe"):
            p = r.obj("probe")
            probe = Probe(p.integer("k"), p.integer("prompts"), p.integer("max_new_tokens"), p.flag("greedy"))
        ppa = None
        if not r.absent("per_position_acceptance"):
            ppa = r.array("per_position_acceptance")
            if not all(x is None or _is_number(x) for x in ppa):
                r.refuse("per_position_acceptance", ppa, "numbers or nulls")
            ppa = tuple(None if x is None else float(x) for x in ppa)
        return cls(
            acceptance=r.opt_number("acceptance"),
            acceptance_fp16_draft=r.opt_number("acceptance_fp16_draft"),
            predicted_speedup=r.opt_number("predicted_speedup"),
            probe=probe,
            per_position_acceptance=ppa,
        )


@dataclass(frozen=True)
class Speculation:
    """The ``speculation`` section: what the engine runs and what the calibration measured."""

    config: SpeculationConfig
    """Drafter, K, its bounds and policy, prompt lookup, and the measured costs (c, v) the K controller uses."""
    measured: SpeculationCalibration
    """Acceptance, predicted speedup and the probe."""

    def to_dict(self) -> dict[str, Any]:
        return {**self.config.to_profile(), **self.measured.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Speculation:
        r = _Fields(d, "speculation", where)
        for key in SPECULATION_REQUIRED:
            r.raw(key)  # "field speculation.<key> is missing", in this order
        for key in ("drafter", "policy"):
            r.string(key)
        for key in ("k", "k_min", "k_max"):
            r.integer(key)
        r.opt_integer("prompt_lookup_min")
        if "c" in r.d:  # the measured costs (Costs.to_dict)
            r.number("c")
            v = r.opt_mapping("v") or {}
            for k, x in v.items():
                if not str(k).isdigit() or not _is_number(x):
                    raise ProfileError(f"{where}: field speculation.v.{k}={x!r:.80} is invalid: allowed K -> a number")
        try:
            config = SpeculationConfig.from_profile(r.d)
        except InvalidConfigError as e:
            raise ProfileError(f"{where}: speculation: {e}") from None
        return cls(config, SpeculationCalibration.from_dict(d, where))


@dataclass(frozen=True)
class Versions:
    """What built the profile (``versions``)."""

    torch: str
    """torch.__version__."""
    specmix: str
    """engine.__version__."""

    def to_dict(self) -> dict[str, Any]:
        return {"torch": self.torch, "specmix": self.specmix}

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Versions:
        r = _Fields(d, "versions", where)
        return cls(r.string("torch"), r.string("specmix"))


# ---------------------------------------------------------------------------- the profile
@dataclass(frozen=True)
class Profile:
    """A built profile (schema_version 1): read and written by this one class (``from_dict`` / ``to_dict``)."""

    gpu: dict[str, Any]
    """The GPU's catalog entry (quant/gpus.json) with its ``name``."""
    validated_on: str
    """The CUDA device name the build ran on, or ``cpu: <processor>``."""
    device: str
    """"cuda" or "cpu": where the gate and calibration ran and where the plan computes."""
    models: Models
    """The target and the draft: reference, weight hashes, config."""
    precision: dict[str, Any]
    """The precision section (docs/design.md section 5: draft_model, main_model {attention, ffn}, verifier)."""
    plan: PrecisionPlan
    """The precision plan (quant.plan_io reads it, ``PrecisionPlan.to_dict`` writes it)."""
    memory: Memory
    """The plan's memory figures."""
    quality: Quality
    """The quality gate: figures, eval text, bounds, every attempt."""
    calibration: CalibrationText
    """The calibration text."""
    speculation: Speculation
    """The speculation settings and their calibration."""
    versions: Versions
    """torch and specmix versions of the build."""
    created_at: str
    """When it was built (UTC, ISO 8601)."""
    name: str | None = None
    """The profile's name (``<gpu>-<model>`` or the output file's stem); None: unnamed."""
    runtime: RuntimeSettings | None = None
    """CUDA graphs and the load window; None: the section is absent (the defaults: eager, window on)."""
    schema_version: int = PROFILE_SCHEMA_VERSION
    """The schema's version (only 1 is read)."""
    path: Path | None = field(default=None, compare=False)
    """The file it was loaded from (``load_profile``); not part of the profile's content, never written."""

    @property
    def where(self) -> str:
        """How errors name the profile: its file, else "profile"."""
        return str(self.path) if self.path is not None else "profile"

    def to_dict(self) -> dict[str, Any]:
        """The profile's JSON object, as written to its file."""
        out: dict[str, Any] = {"schema_version": self.schema_version}
        if self.name is not None:
            out["name"] = self.name
        out.update(
            gpu=copy.deepcopy(self.gpu),
            validated_on=self.validated_on,
            device=self.device,
            models=self.models.to_dict(),
            precision=copy.deepcopy(self.precision),
            plan=self.plan.to_dict(),
            memory=self.memory.to_dict(),
            quality=self.quality.to_dict(),
            calibration=self.calibration.to_dict(),
            speculation=self.speculation.to_dict(),
        )
        if self.runtime is not None:
            out["runtime"] = self.runtime.to_dict()
        out.update(versions=self.versions.to_dict(), created_at=self.created_at)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Profile:
        """Read a profile's JSON object; every refusal is a ProfileError naming ``where`` and the field."""
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: a profile is a JSON object")
        version = d.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION or isinstance(version, bool):
            raise ProfileError(
                f"{where}: schema_version={version!r} is not supported: allowed {PROFILE_SCHEMA_VERSION}"
            )
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise ProfileError(f"{where}: missing field(s) {', '.join(missing)}")
        r = _Fields(d, "", where)
        device = r.string("device")
        if device not in DEVICES:
            r.refuse("device", device, ", ".join(DEVICES))
        try:
            precision = validate_precision(d["precision"])
            plan = plan_from_dict(d["plan"])
        except (InvalidConfigError, ProfileError) as e:
            raise ProfileError(f"{where}: {e}") from None
        return cls(
            gpu=r.mapping("gpu"),
            validated_on=r.string("validated_on"),
            device=device,
            models=Models.from_dict(d["models"], where),
            precision=precision,
            plan=plan,
            memory=Memory.from_dict(d["memory"], where),
            quality=Quality.from_dict(d["quality"], where),
            calibration=CalibrationText.from_dict(d["calibration"], where),
            speculation=Speculation.from_dict(d["speculation"], where),
            versions=Versions.from_dict(d["versions"], where),
            created_at=r.string("created_at"),
            name=r.opt_string("name"),
            runtime=None if d.get("runtime") is None else parse_runtime(d["runtime"], f"{where}: runtime"),
        )


# ---------------------------------------------------------------------------- references, loading
def weight_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in weight_files(model_dir)}


def model_ref(model_dir: Path, demo: tuple[str, Path] | None = None) -> str:
    """How a profile names a model: ``demo:<pair directory>/<role>`` inside the demo cache, else its path.

    ``demo`` is (size, the pair's directory); the directory's name (``demo-<size>-v<recipe>-<digest>``)
    pins the recipe, and it resolves under the specmix cache on any machine.
    """
    if demo is not None:
        _, root = demo
        try:
            rel = Path(model_dir).resolve().relative_to(Path(root).resolve())
            return f"{DEMO_PREFIX}{Path(root).name}/{rel.as_posix()}"
        except ValueError:
            pass
    return str(model_dir)


def resolve_ref(ref: str, where: str = "profile") -> Path:
    """The path of a model (or text) reference written by ``model_ref``."""
    if ref.startswith(DEMO_PREFIX):
        name, _, rel = ref[len(DEMO_PREFIX) :].partition("/")
        root = default_cache_dir() / name
        if not root.is_dir():
            size = name.split("-")[1] if name.count("-") >= 3 else "demo"
            raise ProfileError(
                f"{where}: {ref} is not built on this machine ({root} is missing): "
                f"run python tools/make_demo_models.py --size {size}"
            )
        return root / rel
    return Path(ref)


def verify_weights(prof: Profile, full_check: bool = False) -> None:
    """Refuse (ProfileError) a profile whose weight files are missing or no longer match their sha256."""
    p = prof.where
    for role, m in (("target", prof.models.target), ("draft", prof.models.draft)):
        if m is None:
            continue
        d = resolve_ref(m.path, f"{p}: models.{role}.path")
        for name, want in m.sha256.items():
            f = d / name
            if not f.is_file():
                raise ProfileError(f"{p}: models.{role}.sha256: weight file {f} is missing")
            # the verified (size, mtime, inode) record spares re-reading unchanged weights at every start
            if verified_sha256(f, full=full_check) != want:
                raise ProfileError(
                    f"{p}: models.{role}.sha256: {f} no longer matches the profile "
                    f"(the weights changed): rebuild the profile"
                )


def load_profile(path: str | Path, check_weights: bool = True, full_check: bool = False) -> Profile:
    """Read and validate a profile file; every refusal is a ProfileError naming the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"{p}: profile file is missing")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{p}: invalid JSON ({e})") from None
    prof = dataclasses.replace(Profile.from_dict(d, str(p)), path=p)
    if check_weights:
        verify_weights(prof, full_check)
    return prof


def profile_device(prof: Profile, device: str | torch.device | None) -> torch.device:
    want = torch.device(device) if device is not None else torch.device(prof.device)
    if want.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(
            f"{prof.where}: device={want.type!r}: the profile was built for "
            "CUDA but this machine has no CUDA device; build a profile with --device cpu"
        )
    return want


def calibration_text(prof: Profile) -> str:
    """The calibration text, checked against its sha256."""
    cpath = resolve_ref(prof.calibration.text, f"{prof.where}: calibration.text")
    if not cpath.is_file():
        raise ProfileError(f"{prof.where}: calibration.text {cpath} is missing")
    text = cpath.read_text(encoding="utf-8")
    if hashlib.sha256(text.encode()).hexdigest() != prof.calibration.sha256:
        raise ProfileError(f"{prof.where}: calibration.sha256 does not match {cpath}")
    return text


def engine_options(
    prof: Profile, device: str | torch.device | None = None, limits: Limits | None = None
) -> dict[str, Any]:
    """Arguments of Engine.from_pretrained that rebuild exactly the profile's engine: its models, its
    ``speculation`` section as a SpeculationConfig, its plan as a PrecisionConfig and its ``runtime``
    section as KernelOptions and the load window of ``limits`` (missing CUDA graphs fail here, before
    any weight loads)."""
    where = prof.where
    dev = profile_device(prof, device)
    if prof.plan.device != dev.type:
        raise ProfileError(f"{where}: plan.device={prof.plan.device!r} does not match device={dev.type!r}")
    calib = calibration_text(prof) if prof.calibration.text else None
    rt = runtime_settings(prof.runtime or RuntimeSettings(), dev, f"{where}: runtime")
    kernels, lim = runtime_options(rt, dev, KernelOptions(), limits or Limits())
    draft = prof.models.draft
    return dict(
        target=resolve_ref(prof.models.target.path),
        draft=resolve_ref(draft.path) if draft else None,
        speculation=prof.speculation.config,
        precision=PrecisionConfig(prof.plan, calib),
        limits=lim,
        kernels=kernels,
        device=dev,
    )


def resolve_eval_text(prof: Profile) -> Path:
    """The eval text the profile's quality figures were measured on."""
    return resolve_ref(prof.quality.eval_text, f"{prof.where}: quality.eval_text")

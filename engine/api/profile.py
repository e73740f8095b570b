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
from typing import Any

import torch

from engine.api.options import KernelOptions, Limits, PrecisionConfig
from engine.api.profile_fields import JsonFields
from engine.api.profile_quality import Quality
from engine.api.profile_sections import CalibrationText, Memory, Models, Speculation, Throughput
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
DEVICES = ("cuda", "cpu")
DEMO_PREFIX = "demo:"


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
        r = JsonFields(d, "versions", where)
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
    throughput: Throughput | None = None
    """The build's decoding of the planned models against the unquantized ones; None: not measured."""
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
        if self.throughput is not None:
            out["throughput"] = self.throughput.to_dict()
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
        r = JsonFields(d, "", where)
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
            throughput=None if d.get("throughput") is None else Throughput.from_dict(d["throughput"], where),
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

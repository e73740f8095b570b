"""Profiles: the JSON a build writes and a service loads (``Engine.from_profile``).

A profile names its models (demo pairs as ``demo:<pair directory>/<role>``, other models by
path), the sha256 of every weight file, the precision section and plan, the
quality gate's figures, the speculation settings, and versions. Loading checks
all of it and refuses, with a ProfileError naming the file and the field, a
profile that does not match the machine or the weights on disk.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from engine.api.options import KernelOptions, Limits, PrecisionConfig, SpeculationConfig
from engine.core.checkpoint import weight_files
from engine.core.errors import InvalidConfigError, ProfileError
from engine.core.files import default_cache_dir, sha256_file, verified_sha256
from quant.plan_io import plan_from_dict

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
DEMO_PREFIX = "demo:"


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


def load_profile(path: str | Path, check_weights: bool = True, full_check: bool = False) -> dict[str, Any]:
    """Read and validate a profile; every refusal is a ProfileError naming the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"{p}: profile file is missing")
    try:
        prof = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{p}: invalid JSON ({e})") from None
    if not isinstance(prof, dict):
        raise ProfileError(f"{p}: a profile is a JSON object")
    if prof.get("schema_version") != PROFILE_SCHEMA_VERSION:
        raise ProfileError(
            f"{p}: schema_version={prof.get('schema_version')!r} is not supported: allowed {PROFILE_SCHEMA_VERSION}"
        )
    missing = [k for k in REQUIRED if k not in prof]
    if missing:
        raise ProfileError(f"{p}: missing field(s) {', '.join(missing)}")
    models = prof["models"]
    if not isinstance(models, dict) or "target" not in models:
        raise ProfileError(f"{p}: field models.target is missing")
    for role, m in models.items():
        if m is None:
            continue
        for key in ("path", "sha256", "config"):
            if key not in m:
                raise ProfileError(f"{p}: field models.{role}.{key} is missing")
        if check_weights:
            d = resolve_ref(m["path"], f"{p}: models.{role}.path")
            for name, want in m["sha256"].items():
                f = d / name
                if not f.is_file():
                    raise ProfileError(f"{p}: models.{role}.sha256: weight file {f} is missing")
                # the verified (size, mtime, inode) record spares re-reading unchanged weights at every start
                if verified_sha256(f, full=full_check) != want:
                    raise ProfileError(
                        f"{p}: models.{role}.sha256: {f} no longer matches the profile "
                        f"(the weights changed): rebuild the profile"
                    )
    spec = prof["speculation"]
    for key in ("drafter", "k", "k_min", "k_max", "policy"):
        if key not in spec:
            raise ProfileError(f"{p}: field speculation.{key} is missing")
    from engine.api.runtime import parse_runtime

    parse_runtime(prof.get("runtime"), f"{p}: runtime")  # optional section: CUDA graphs, load window
    prof["_path"] = str(p)
    return prof


def profile_device(prof: dict[str, Any], device: str | torch.device | None) -> torch.device:
    want = torch.device(device) if device is not None else torch.device(prof["device"])
    if want.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(
            f"{prof.get('_path', 'profile')}: device={want.type!r}: the profile was built for "
            "CUDA but this machine has no CUDA device; build a profile with --device cpu"
        )
    return want


def engine_options(
    prof: dict[str, Any], device: str | torch.device | None = None, limits: Limits | None = None
) -> dict[str, Any]:
    """Arguments of Engine.from_pretrained that rebuild exactly the profile's engine: its models, its
    ``speculation`` section as a SpeculationConfig, its plan as a PrecisionConfig and its ``runtime``
    section as KernelOptions and the load window of ``limits`` (missing CUDA graphs fail here, before
    any weight loads)."""
    from engine.api.runtime import runtime_options, runtime_settings

    where = prof.get("_path", "profile")
    dev = profile_device(prof, device)
    try:
        plan = plan_from_dict(prof["plan"])
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from None
    if plan.device != dev.type:
        raise ProfileError(f"{where}: plan.device={plan.device!r} does not match device={dev.type!r}")
    cal = prof["calibration"]
    calib = None
    if cal.get("text"):
        cpath = resolve_ref(cal["text"], f"{where}: calibration.text")
        if not cpath.is_file():
            raise ProfileError(f"{where}: calibration.text {cpath} is missing")
        calib = cpath.read_text(encoding="utf-8")
        if hashlib.sha256(calib.encode()).hexdigest() != cal.get("sha256"):
            raise ProfileError(f"{where}: calibration.sha256 does not match {cpath}")
    draft = prof["models"].get("draft")
    try:
        spec = SpeculationConfig.from_profile(prof["speculation"])
    except (InvalidConfigError, KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{where}: speculation: {e}") from None
    kernels, lim = runtime_options(runtime_settings(prof, dev), dev, KernelOptions(), limits or Limits())
    return dict(
        target=resolve_ref(prof["models"]["target"]["path"]),
        draft=resolve_ref(draft["path"]) if draft else None,
        speculation=spec,
        precision=PrecisionConfig(plan, calib),
        limits=lim,
        kernels=kernels,
        device=dev,
    )


def resolve_eval_text(prof: dict[str, Any]) -> Path:
    """The eval text the profile's quality figures were measured on."""
    return resolve_ref(prof["quality"]["eval_text"], f"{prof.get('_path', 'profile')}: quality.eval_text")

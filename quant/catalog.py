"""The GPU catalog (quant/gpus.json, shipped in the package): look-up by name, case-insensitive, with aliases.

An entry, as returned by :func:`lookup_gpu` (a fresh dict; ``name`` added)::

    {"name": "a100-40gb", "compute_capability": "8.0", "memory_bytes": ..., "memory_gib": 40,
     "memory_bandwidth_gbps": 1555, "tensor_tflops": {"fp16": 312, "int8": 624, "fp8": None},
     "tensor_cores": {"fp16", "bf16", "int8", "fp8": bool},
     "flash_attn_2": bool, "device_names": [...], "source": "..."}
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

from engine.core.errors import InvalidConfigError, ProfileError

CATALOG_SCHEMA_VERSION = 1
REQUIRED_FIELDS = (
    "compute_capability",
    "memory_bytes",
    "memory_bandwidth_gbps",
    "tensor_cores",
    "flash_attn_2",
    "source",
)
TENSOR_CORE_KINDS = ("fp16", "bf16", "int8", "fp8")


def validate_gpu(entry: Any, where: str = "gpu") -> dict[str, Any]:
    """Check one catalog entry; a missing or malformed field is a ProfileError naming it."""
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: must be a JSON object, got {type(entry).__name__}")
    for f in REQUIRED_FIELDS:
        if f not in entry:
            raise ProfileError(f"{where}.{f} is missing; required fields: {', '.join(REQUIRED_FIELDS)}")
    compute_capability(entry, where)
    if not isinstance(entry["memory_bytes"], int) or entry["memory_bytes"] <= 0:
        raise ProfileError(f"{where}.memory_bytes={entry['memory_bytes']!r} is invalid: allowed a positive integer")
    tc = entry["tensor_cores"]
    if not isinstance(tc, dict) or any(not isinstance(tc.get(k), bool) for k in TENSOR_CORE_KINDS):
        raise ProfileError(
            f"{where}.tensor_cores={tc!r} is invalid: allowed an object with boolean {', '.join(TENSOR_CORE_KINDS)}"
        )
    tf = entry.get("tensor_tflops")
    if tf is not None and (
        not isinstance(tf, dict)
        or not isinstance(tf.get("fp16"), (int, float))
        or any(tf.get(k) is not None and not isinstance(tf.get(k), (int, float)) for k in ("int8", "fp8"))
    ):
        raise ProfileError(
            f"{where}.tensor_tflops={tf!r} is invalid: allowed an object with a number fp16 and "
            "numbers or null int8, fp8"
        )
    if not isinstance(entry["flash_attn_2"], bool):
        raise ProfileError(f"{where}.flash_attn_2={entry['flash_attn_2']!r} is invalid: allowed true or false")
    return entry


def compute_capability(entry: dict[str, Any], where: str = "gpu") -> tuple[int, int]:
    """``"8.9"`` -> ``(8, 9)``."""
    cc = entry.get("compute_capability")
    try:
        major, minor = str(cc).split(".")
        return int(major), int(minor)
    except ValueError:
        raise ProfileError(f"{where}.compute_capability={cc!r} is invalid: allowed 'MAJOR.MINOR', e.g. '8.9'") from None


def load_catalog(path: str | Path | None = None) -> dict[str, Any]:
    """Read and validate the catalog (default: the one shipped in this package, quant/gpus.json)."""
    p = Path(path) if path is not None else resources.files("quant") / "gpus.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"{p}: GPU catalog is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{p}: unreadable GPU catalog ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise ProfileError(f"{p}: the catalog must be an object with a 'gpus' object")
    if data.get("schema_version") != CATALOG_SCHEMA_VERSION:
        raise ProfileError(
            f"{p}: schema_version={data.get('schema_version')!r} is not supported; supported: {CATALOG_SCHEMA_VERSION}"
        )
    for name, entry in data["gpus"].items():
        validate_gpu(entry, f"{p}: gpus.{name}")
    for alias, target in (data.get("aliases") or {}).items():
        if target not in data["gpus"]:
            raise ProfileError(f"{p}: aliases.{alias} -> {target!r} names no GPU in the catalog")
    return data


def known_gpus(catalog: dict[str, Any] | None = None) -> list[str]:
    return sorted((catalog or load_catalog())["gpus"])


def lookup_gpu(name: str, catalog: dict[str, Any] | None = None) -> dict[str, Any]:
    """The entry for ``name`` (case-insensitive; aliases such as a100 -> a100-80gb, h100 -> h100-sxm).

    An unknown name is an InvalidConfigError listing the known names and aliases.
    """
    cat = catalog or load_catalog()
    key = str(name).strip().lower()
    aliases = {k.lower(): v for k, v in (cat.get("aliases") or {}).items()}
    key = aliases.get(key, key)
    if key not in cat["gpus"]:
        alias_text = ", ".join(f"{a} -> {t}" for a, t in sorted(aliases.items()))
        raise InvalidConfigError(
            f"gpu={name!r} is not in the GPU catalog; known: {', '.join(known_gpus(cat))}"
            + (f" (aliases: {alias_text})" if alias_text else "")
        )
    entry = copy.deepcopy(cat["gpus"][key])
    entry["name"] = key
    return entry


def gpu_for_device_name(device_name: str, catalog: dict[str, Any] | None = None) -> dict[str, Any]:
    """The entry whose ``device_names`` holds ``device_name`` (as NVML / torch.cuda report it)."""
    cat = catalog or load_catalog()
    want = device_name.strip().lower()
    for key, entry in cat["gpus"].items():
        if want in (n.lower() for n in entry.get("device_names", [])):
            return lookup_gpu(key, cat)
    raise InvalidConfigError(
        f"GPU {device_name!r} is not in the GPU catalog; pass --gpu with one of: {', '.join(known_gpus(cat))}"
    )

"""The profile's optional ``runtime`` section: CUDA graphs and the load-aware window.

```json
"runtime": {
  "cuda_graphs": {"enabled": true, "batch_buckets": [1, 2, 4, 8, 16, 32]},
  "load_window": {"enabled": true, "memory_threshold": 0.80, "resume_below": 0.70}
}
```

A profile without the section (or without ``cuda_graphs``) runs eagerly; a present
``cuda_graphs`` object defaults to enabled with the buckets above. The load window
defaults to on with threshold 0.80; it needs a GPU reader, so on the CPU it is a no-op.
A CUDA profile that enables graphs on a machine that cannot capture them fails at
load with KernelUnavailableError; a CPU profile runs eagerly (graphs are a GPU
runtime matter, never a plan choice). Bad values are ProfileErrors naming the field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.api.options import KernelOptions, Limits, LoadWindowConfig
from engine.core.errors import InvalidConfigError, ProfileError
from engine.kernels.backends import HardwareFacts, probe_hardware, require_cuda_graphs
from engine.kernels.cudagraphs import DEFAULT_BATCH_BUCKETS, check_buckets
from engine.runtime.telemetry import (
    DEFAULT_RESUME,
    DEFAULT_THRESHOLD,
    LoadGovernor,
    LoadWindow,
    make_reader,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeSettings:
    """A profile's ``runtime`` section (``parse_runtime`` reads it, ``to_dict`` writes it)."""

    cuda_graphs: bool = False
    """Capture the draft and verify steps as CUDA graphs (CUDA profiles only; a CPU engine runs eagerly)."""
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    """Batch sizes a graph is captured for."""
    load_window: bool = True
    """Lower K and the batch under GPU memory pressure (a no-op on the CPU)."""
    memory_threshold: float = DEFAULT_THRESHOLD
    """GPU memory in use (0..1) above which the window narrows."""
    resume_below: float = DEFAULT_RESUME
    """GPU memory in use (0..1) below which it widens again."""

    def to_dict(self) -> dict[str, Any]:
        """The section as a profile writes it (both objects, every field)."""
        return {
            "cuda_graphs": {"enabled": self.cuda_graphs, "batch_buckets": list(self.batch_buckets)},
            "load_window": {
                "enabled": self.load_window,
                "memory_threshold": self.memory_threshold,
                "resume_below": self.resume_below,
            },
        }


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProfileError(f"{where}={v!r} is invalid: allowed a JSON object")
    return v


def _bool(d: dict[str, Any], key: str, default: bool, where: str) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ProfileError(f"{where}.{key}={v!r} is invalid: allowed true or false")
    return v


def parse_runtime(section: Any, where: str = "runtime") -> RuntimeSettings:
    """Validate a runtime section (None: the defaults)."""
    if section is None:
        return RuntimeSettings()
    sec = _obj(section, where)
    unknown = sorted(set(sec) - {"cuda_graphs", "load_window"})
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: cuda_graphs, load_window")
    kw: dict[str, Any] = {}
    if "cuda_graphs" in sec:
        cg = _obj(sec["cuda_graphs"], f"{where}.cuda_graphs")
        kw["cuda_graphs"] = _bool(cg, "enabled", True, f"{where}.cuda_graphs")
        try:
            kw["batch_buckets"] = check_buckets(
                cg.get("batch_buckets", list(DEFAULT_BATCH_BUCKETS)), f"{where}.cuda_graphs.batch_buckets"
            )
        except InvalidConfigError as e:
            raise ProfileError(str(e)) from None
    if "load_window" in sec:
        lw = _obj(sec["load_window"], f"{where}.load_window")
        kw["load_window"] = _bool(lw, "enabled", True, f"{where}.load_window")
        thr, res = lw.get("memory_threshold", DEFAULT_THRESHOLD), lw.get("resume_below", DEFAULT_RESUME)
        try:
            LoadWindow(1, 1, threshold=thr, resume=res)  # the same checks the policy makes
        except InvalidConfigError as e:
            raise ProfileError(f"{where}.load_window: {e}") from None
        kw["memory_threshold"], kw["resume_below"] = float(thr), float(res)
    return RuntimeSettings(**kw)


def runtime_settings(
    rt: RuntimeSettings, device: torch.device, where: str = "runtime", facts: HardwareFacts | None = None
) -> RuntimeSettings:
    """A profile's runtime (named ``where`` in errors), checked against the machine (KernelUnavailableError for
    missing CUDA graphs)."""
    if rt.cuda_graphs:
        if device.type == "cpu":
            log.info("%s.cuda_graphs is enabled but the engine runs on the CPU: eager execution", where)
            return replace(rt, cuda_graphs=False)
        require_cuda_graphs(facts or probe_hardware(device), f"{where}.cuda_graphs")
    return rt


def make_governor(
    device: torch.device, cfg: LoadWindowConfig, k_min: int, k_max: int, max_batch: int
) -> tuple[Any, LoadGovernor | None]:
    """(the GPU reader, the load window's governor) for an engine; (None, None) where no reader runs (the CPU)."""
    reader = cfg.reader if cfg.reader is not None else make_reader(device)
    if reader is None:
        return None, None
    window = LoadWindow(
        k_max=k_max, batch_max=max_batch, threshold=cfg.memory_threshold, resume=cfg.resume_below, k_min=k_min
    )
    return reader, LoadGovernor(reader, window)


def runtime_options(
    rt: RuntimeSettings, device: torch.device, kernels: KernelOptions, limits: Limits
) -> tuple[KernelOptions, Limits]:
    """The profile's runtime section as the engine's options (graphs only on CUDA)."""
    kernels = replace(kernels, cuda_graphs=rt.cuda_graphs and device.type == "cuda", batch_buckets=rt.batch_buckets)
    lw = LoadWindowConfig(rt.memory_threshold, rt.resume_below) if rt.load_window else None
    return kernels, replace(limits, load_window=lw)

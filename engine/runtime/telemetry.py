"""GPU telemetry (NVML through nvidia-ml-py, imported lazily) and the load-aware window.

``LoadWindow`` is a pure policy: it takes a memory-use fraction per reading and
returns (k cap, batch cap). At or above ``threshold`` each reading halves both
caps (down to their floors); ``raise_after`` consecutive readings at or below
``resume`` double them again (up to the configured maximum); between the two
it holds (hysteresis, so a reading hovering at the threshold does not flap).

``LoadGovernor`` feeds it readings from a reader at most every ``interval_s``;
the scheduler polls it before each round, admits no more than the batch cap and
the loop caps the K of every row but seeded sampled ones of a drafter that samples
(whose tokens must not depend on the load: their K decides their random draws). What
shrinks is the per-round memory (verify logits, draft probabilities and noise, all
proportional to batch x (K + 1) x vocab, plus
activations): the engine slows down instead of running out of memory when other
work fills the GPU. The static KV cache is not resized.

Readers: ``NvmlReader`` (device memory used/total and utilization, as
nvidia-smi shows them) on CUDA with nvidia-ml-py; ``TorchMemInfoReader``
(cudaMemGetInfo: the same memory figures, no utilization) on CUDA without it;
none on the CPU, where the window is a no-op.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from engine.core.errors import InvalidConfigError, KernelUnavailableError

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.80
DEFAULT_RESUME = 0.70


@dataclass(frozen=True)
class GpuReading:
    used_bytes: int
    total_bytes: int
    utilization_pct: float | None = None  # busy time of the last sample period (NVML only)

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_used_bytes": self.used_bytes,
            "memory_total_bytes": self.total_bytes,
            "memory_used_fraction": round(self.fraction, 4),
            "utilization_pct": self.utilization_pct,
        }


class Reader(Protocol):
    source: str

    def read(self) -> GpuReading: ...


class NvmlReader:
    """NVML figures of the GPU behind a torch CUDA device (matched by UUID, so CUDA_VISIBLE_DEVICES is safe)."""

    source = "nvml"

    def __init__(self, device: torch.device | str) -> None:
        try:
            self._nvml = importlib.import_module("pynvml")
        except ImportError:
            raise KernelUnavailableError(
                "GPU telemetry needs NVML: pip install 'specmix[nvml]' (nvidia-ml-py)"
            ) from None
        dev = torch.device(device)
        self._nvml.nvmlInit()
        uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
        self._handle = None
        if uuid is not None:
            text = str(uuid)
            try:
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
            except self._nvml.NVMLError as e:
                log.warning("NVML does not know torch's UUID %s (%s): using CUDA index %d", text, e, dev.index or 0)
        if self._handle is None:  # the CUDA index: right unless CUDA_VISIBLE_DEVICES reorders the GPUs
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(dev.index or 0)

    def read(self) -> GpuReading:
        """The current figures; RuntimeError when NVML fails (the governor then holds its caps)."""
        try:
            m = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            u = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        except self._nvml.NVMLError as e:
            raise RuntimeError(f"NVML read failed: {e}") from None
        return GpuReading(int(m.used), int(m.total), float(u.gpu))

    def name(self) -> str:
        n = self._nvml.nvmlDeviceGetName(self._handle)
        return n.decode() if isinstance(n, bytes) else str(n)

    def close(self) -> None:
        self._nvml.nvmlShutdown()


class TorchMemInfoReader:
    """cudaMemGetInfo through torch: device-wide memory, no utilization."""

    source = "cudaMemGetInfo"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def read(self) -> GpuReading:
        free, total = torch.cuda.mem_get_info(self.device)
        return GpuReading(int(total - free), int(total), None)


def make_reader(device: torch.device | str, nvml: bool | None = None) -> Reader | None:
    """NVML on CUDA when nvidia-ml-py is installed, cudaMemGetInfo on CUDA without it, None on the CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if nvml is None:
        nvml = importlib.util.find_spec("pynvml") is not None
    if nvml:
        return NvmlReader(dev)
    log.info("nvidia-ml-py is not installed: GPU memory from cudaMemGetInfo, no utilization figures")
    return TorchMemInfoReader(dev)


def _check_fraction(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) <= 1.0:
        raise InvalidConfigError(f"{name}={v!r} is invalid: allowed a number in (0, 1]")
    return float(v)


@dataclass
class LoadWindow:
    """Caps on K and the admitted batch from memory-use readings, with hysteresis (see the module doc)."""

    k_max: int
    batch_max: int
    threshold: float = DEFAULT_THRESHOLD
    resume: float = DEFAULT_RESUME
    raise_after: int = 3
    k_min: int = 1
    batch_min: int = 1
    k_cap: int = field(init=False)
    batch_cap: int = field(init=False)
    _low: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.threshold = _check_fraction("memory_threshold", self.threshold)
        self.resume = _check_fraction("resume_below", self.resume)
        if self.resume >= self.threshold:
            raise InvalidConfigError(
                f"resume_below={self.resume} is invalid: allowed below memory_threshold={self.threshold}"
            )
        for name, v, lo in (
            ("k_max", self.k_max, 0),
            ("batch_max", self.batch_max, 1),
            ("raise_after", self.raise_after, 1),
            ("k_min", self.k_min, 0),
            ("batch_min", self.batch_min, 1),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise InvalidConfigError(f"{name}={v!r} is invalid: allowed an int >= {lo}")
        self.k_min, self.batch_min = min(self.k_min, self.k_max), min(self.batch_min, self.batch_max)
        self.k_cap, self.batch_cap = self.k_max, self.batch_max

    @property
    def throttled(self) -> bool:
        return self.k_cap < self.k_max or self.batch_cap < self.batch_max

    def update(self, fraction: float | None) -> tuple[int, int]:
        """One reading (None: no reading, hold) -> (k cap, batch cap)."""
        if fraction is None:
            return self.k_cap, self.batch_cap
        if fraction >= self.threshold:
            self._low = 0
            k, b = max(self.k_min, self.k_cap // 2), max(self.batch_min, self.batch_cap // 2)
            if (k, b) != (self.k_cap, self.batch_cap):
                log.warning(
                    "GPU memory at %.0f%% (threshold %.0f%%): lowering K cap %d -> %d, batch cap %d -> %d",
                    100 * fraction,
                    100 * self.threshold,
                    self.k_cap,
                    k,
                    self.batch_cap,
                    b,
                )
            self.k_cap, self.batch_cap = k, b
        elif fraction <= self.resume:
            self._low += 1
            if self._low >= self.raise_after and self.throttled:
                self._low = 0
                k, b = min(self.k_max, max(1, self.k_cap) * 2), min(self.batch_max, self.batch_cap * 2)
                log.info(
                    "GPU memory at %.0f%%: raising K cap %d -> %d, batch cap %d -> %d",
                    100 * fraction,
                    self.k_cap,
                    k,
                    self.batch_cap,
                    b,
                )
                self.k_cap, self.batch_cap = k, b
        else:
            self._low = 0
        return self.k_cap, self.batch_cap


class LoadGovernor:
    """A reader and a LoadWindow: ``poll()`` reads at most every ``interval_s`` and returns the caps."""

    def __init__(
        self, reader: Reader, window: LoadWindow, interval_s: float = 0.25, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.reader, self.window, self.interval_s, self.clock = reader, window, interval_s, clock
        self.last: GpuReading | None = None
        self._at: float | None = None

    def poll(self) -> tuple[int, int]:
        now = self.clock()
        if self._at is None or now - self._at >= self.interval_s:
            self._at = now
            try:
                self.last = self.reader.read()
            except RuntimeError as e:  # telemetry must not stop serving: hold the caps, say so
                log.warning("GPU telemetry (%s) failed, holding the load window's caps: %s", self.reader.source, e)
                return self.window.k_cap, self.window.batch_cap
            return self.window.update(self.last.fraction)
        return self.window.k_cap, self.window.batch_cap

    def snapshot(self) -> dict[str, Any]:
        w = self.window
        return {
            "source": self.reader.source,
            "memory_threshold": w.threshold,
            "resume_below": w.resume,
            "k_cap": w.k_cap,
            "batch_cap": w.batch_cap,
            "throttled": w.throttled,
            "last_reading": None if self.last is None else self.last.to_dict(),
        }


def gpu_stats(device: torch.device, reader: Reader | None) -> dict[str, Any] | None:
    """Engine.stats()'s GPU section: a fresh reading (None on the CPU or without a reader)."""
    if device.type != "cuda" or reader is None:
        return None
    try:
        out = reader.read().to_dict()
    except RuntimeError as e:
        return {"source": reader.source, "error": str(e)}
    out["source"] = reader.source
    return out

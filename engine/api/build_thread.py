"""Build an engine's model on a thread that ends with the build, so the caller's thread keeps no OpenMP team.

On the CPU, PyTorch's kernels and the C++ decode step run their parallel regions on OpenMP (libgomp). libgomp keeps
a team of threads for every thread that ever ran a parallel region, for as long as that thread lives, and once the
teams' threads outnumber the cores it stops spinning between regions: each region then waits for its team to wake
from a futex. Loading a model runs parallel regions (copies, packing, quantization), so a model loaded in the
caller's thread leaves a team there; the scheduler's worker thread, which runs the served rounds, then owns a second
team and every round's kernels wake slowly (a decode step of the demo pair on 2 cores: about 1.5x as long). A thread
that ends frees its team, so the build runs on one.

The build's thread inherits nothing thread-local from the caller that it needs: devices are explicit and the build
runs under its own grad mode. On CUDA the build stays in the caller's thread (the current device and stream are
thread-local, and the hot path runs on the GPU, not on OpenMP).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def build_off_thread(build: Callable[[], T], dev: torch.device) -> T:
    """``build()`` on a new thread that ends when it returns (on the CPU; on CUDA in this thread): its result, or
    its exception raised here."""
    if dev.type != "cpu":
        return build()
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(build())
        except BaseException as e:  # noqa: BLE001 - handed to the caller below, as raised
            err.append(e)

    t = threading.Thread(target=run, name="specmix-build")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]

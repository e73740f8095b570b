#!/usr/bin/env python
"""Time the CPU few-row GEMMs (engine/kernels/csrc) per weight storage: fp32, fp16, and int8 per output
channel or per group of 32, 64, 128 input channels, on random weights of the given shapes; on a CPU with AMX also
bf16 and int8 on its tiles (``-amx``).

    python tools/bench_cpu_kernels.py [--shapes 3072x576,576x1536,49152x576] [--rows 1,9] [--threads 1]

Each storage gets enough copies of the weight to fill ``--stream-mib`` MiB, cycled so every call streams its
weight from memory as a decode step does (a step reads each weight once). A figure is the median over
``--repeats`` sweeps of microseconds per call, with the weight bytes read per second and the speedup over fp32
in the same run. Prints one Markdown table.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.core.cli import ArgumentError, OneLineParser, run_tool

log = logging.getLogger("bench_cpu_kernels")

STORAGES = ("fp32", "fp16", "int8", "int8/g32", "int8/g64", "int8/g128")
AMX_STORAGES = ("bf16-amx", "int8-amx", "int8-amx/g32", "int8-amx/g64", "int8-amx/g128")


def storages(kernels: Any) -> tuple[str, ...]:
    """STORAGES, then the AMX tiles' where this CPU runs them."""
    ok = {"bf16": not kernels.amx_status(), "int8": not kernels.int8_amx_status()}
    return STORAGES + tuple(s for s in AMX_STORAGES if ok[s.split("-")[0]])


def _ints(text: str, what: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ArgumentError(f"{what}={text!r} is invalid: allowed comma-separated integers") from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise ArgumentError(f"{what}={text!r} is invalid: allowed integers in [{lo}, {hi}]")
    return vals


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        dims = part.strip().split("x")
        if len(dims) != 2 or not all(d.isdigit() and 0 < int(d) <= 1 << 17 for d in dims):
            raise ArgumentError(f"--shapes {part!r} is invalid: allowed NxK with 1 <= N, K <= 131072")
        out.append((int(dims[0]), int(dims[1])))
    return out


def _weight(kernels: Any, storage: str, w: torch.Tensor) -> tuple[Any, int]:
    """The weight as the kernel takes it, and the bytes a call reads (int8 scales included)."""
    from quant.int8 import quantize_int8_groupwise, quantize_int8_rowwise

    if storage == "bf16-amx":
        return (kernels.amx_pack(w.bfloat16()), w.shape[0]), w.numel() * 2
    if storage in ("fp32", "fp16"):
        t = w.clone() if storage == "fp32" else w.half()  # a copy of its own: the copies must not share memory
        return t, t.numel() * t.element_size()
    group = int(storage.split("/g")[1]) if "/g" in storage else 0
    q, s = quantize_int8_groupwise(w, group) if group else quantize_int8_rowwise(w)
    return (q, s, group), q.numel() + s.numel() * 4


def _call(kernels: Any, x: torch.Tensor, storage: str) -> Callable[[Any], torch.Tensor]:
    if storage in ("fp32", "fp16"):
        return lambda wt: kernels.small_gemm(x, wt)
    if storage == "bf16-amx":
        return lambda wt: kernels.amx_gemm(x, wt[0], wt[1])
    gemm = kernels.int8_amx_gemm if storage.startswith("int8-amx") else kernels.int8_gemm
    return lambda wt: gemm(x, wt[0], wt[1], wt[2])


def time_storage(kernels: Any, shape: tuple[int, int], rows: int, storage: str, stream_mib: int, repeats: int) -> dict:
    """Median microseconds per call of one storage, its weight cycled through ``stream_mib`` MiB."""
    n, k = shape
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.05
    first, nbytes = _weight(kernels, storage, w)
    copies = [first] + [_weight(kernels, storage, w)[0] for _ in range(max(2, (stream_mib << 20) // nbytes) - 1)]
    f = _call(kernels, torch.randn(rows, k), storage)
    for wt in copies[:2]:
        f(wt)
    sweeps = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for wt in copies:
            f(wt)
        sweeps.append((time.perf_counter() - t0) / len(copies))
    t = statistics.median(sweeps)
    return {"us": t * 1e6, "gb_s": nbytes / t / 1e9}


def run(shapes: list[tuple[int, int]], rows: list[int], stream_mib: int, repeats: int) -> str:
    from engine.kernels.cpu_gemm import cpu_kernels

    kernels = cpu_kernels()  # KernelUnavailableError (an EngineError) says why, in one line
    names = storages(kernels)
    head = "| shape [N, K] | rows | " + " | ".join(names) + " |"
    lines = [head, "|---|---|" + "---|" * len(names)]
    for shape in shapes:
        for m in rows:
            res = {s: time_storage(kernels, shape, m, s, stream_mib, repeats) for s in names}
            base = res["fp32"]["us"]
            cells = [f"{r['us']:.0f} µs, {r['gb_s']:.1f} GB/s, {base / r['us']:.2f}x" for r in res.values()]
            lines.append(f"| [{shape[0]}, {shape[1]}] | {m} | " + " | ".join(cells) + " |")
            log.info("%s rows %d done", shape, m)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("--shapes", default="3072x576,576x1536,49152x576", help="comma-separated NxK weight shapes")
    ap.add_argument("--rows", default="1,9", help="comma-separated input row counts (1-512: a decode step to a prompt)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the kernels' parallel_for; 1-1024)")
    ap.add_argument("--stream-mib", type=int, default=96, help="MiB of weight copies cycled per storage (1-4096)")
    ap.add_argument("--repeats", type=int, default=7, help="sweeps over the copies; the median is reported (1-100)")

    def body() -> int:
        a = ap.parse_args(argv)
        shapes, rows = _shapes(a.shapes), _ints(a.rows, "--rows", 1, 512)
        for name, v, hi in (
            ("--threads", a.threads, 1024),
            ("--stream-mib", a.stream_mib, 4096),
            ("--repeats", a.repeats, 100),
        ):
            if not 1 <= v <= hi:
                raise ArgumentError(f"{name}={v} is invalid: allowed an integer in [1, {hi}]")
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        torch.set_num_threads(a.threads)
        sys.stdout.write(run(shapes, rows, a.stream_mib, a.repeats) + "\n")
        return 0

    return run_tool("bench_cpu_kernels", body)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The GPU's two ceilings and the quantized Linears' kernels against fp16 (random data, no checkpoint).

    python tools/gpu_kernels.py [--device cuda] [--out DIR]
    python tools/gpu_kernels.py --device cpu --small --out DIR      # smoke mode (tiny shapes; CI)

Ceilings: a device-to-device copy (bytes read + written over time) and a bf16 matrix
product of random data (FLOP over time). Kernels: every kernel of quant/matmul_kernels.py
that runs here (fp16 ``F.linear`` as the base; FP8 native / weight-only; INT8 W8A8,
W8A16 per channel and per group of 128, LLM.int8) on the Llama-2-7B Linear shapes, at
M = 1, 8, 32 and 128 rows. Each figure is the median over ``--repeats`` of one pass over
enough copies of the weight to exceed the L2 cache, replayed from a CUDA graph where the
kernel captures (else eager, and the table says so). Each kernel's error is
||y - ref|| / ||ref|| against the fp64 product of the same dequantized-free inputs.
Writes gpu-kernels.json and gpu-kernels.md to --out.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.cli.gpu_bench import write_results
from quant.linear import FP8Linear, Int8Linear
from quant.matmul_kernels import kernel_available

log = logging.getLogger("gpu_kernels")

SHAPES = {"qkvo 4096x4096": (4096, 4096), "gate/up 11008x4096": (11008, 4096), "down 4096x11008": (4096, 11008)}
SMALL_SHAPES = {"small 256x128": (256, 128)}
KERNELS: tuple[tuple[str, str, str, int | None], ...] = (  # label, family, kernel, group size
    ("fp8 native", "fp8", "native", None),
    ("fp8 weight-only", "fp8", "weight-only", None),
    ("int8 w8a8", "int8", "w8a8", None),
    ("int8 w8a16", "int8", "w8a16", None),
    ("int8 w8a16 g128", "int8", "w8a16", 128),
    ("int8 llm-int8", "int8", "llm-int8", None),
)
L2_MULTIPLE_BYTES = 256 << 20  # each timed pass reads at least this many weight bytes (H200 L2: 50 MiB)


class Clock:
    """Median seconds of one call of ``fn`` over ``repeats``: CUDA events around graph replays (or eager calls)."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, str]:
        if self.device.type != "cuda":
            fn()
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), "eager"
        run, how = fn, "eager"
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            run, how = graph.replay, "graph"
        except RuntimeError as e:  # a kernel that syncs or allocates on the host cannot be captured: time it eagerly
            log.info("not capturable (%s): timed eagerly", str(e).splitlines()[0][:120])
            torch.cuda.synchronize()
        run()
        times = []
        for _ in range(self.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times), how


def ceilings(dev: torch.device, clock: Clock, small: bool) -> dict[str, float]:
    """Copy bandwidth (TB/s, bytes read + written) and the bf16 matrix rate (TFLOP/s), both on random data."""
    n = (1 << 20) if small else (1 << 30)  # 2 GiB of bf16 per buffer on the GPU
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t_copy, _ = clock(lambda: dst.copy_(src))
    s = 256 if small else 8192
    a, b = (torch.randn(s, s, device=dev, dtype=torch.bfloat16) for _ in range(2))
    t_mm, _ = clock(lambda: torch.mm(a, b))
    return {"copy_tbps": 2 * n * 2 / t_copy / 1e12, "bf16_tflops": 2 * s**3 / t_mm / 1e12}


def linears(make: Callable[[nn.Linear], nn.Module], base: list[nn.Linear]) -> list[nn.Module]:
    return [make(lin) for lin in base]


def one_kernel(mods: list[nn.Module], x: torch.Tensor, ref: torch.Tensor, clock: Clock) -> tuple[float, str, float]:
    """(seconds per Linear call, timing mode, relative error of the first copy's output)."""
    out = mods[0](x)
    err = float((out.double() - ref).norm() / ref.norm())
    if not torch.isfinite(out).all():
        err = float("nan")
    t, how = clock(lambda: [m(x) for m in mods])
    return t / len(mods), how, err


def run(a: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(a.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    clock = Clock(dev, a.repeats)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "ceilings": ceilings(dev, clock, a.small),
        "rows": [],
        "unavailable": {},
    }
    torch.manual_seed(0)
    for sname, (n_out, n_in) in (SMALL_SHAPES if a.small else SHAPES).items():
        copies = max(2, -(-L2_MULTIPLE_BYTES // (n_out * n_in * 2))) if dev.type == "cuda" else 2
        base = [nn.Linear(n_in, n_out, bias=False, device=dev, dtype=dtype) for _ in range(copies)]
        with torch.no_grad():
            for lin in base:
                lin.weight.normal_(0.0, 0.02)
        for m in a.rows:
            x = torch.randn(m, n_in, device=dev, dtype=dtype)
            ref = x.double() @ base[0].weight.double().t()
            with torch.no_grad():
                t16, how16, err16 = one_kernel(base, x, ref, clock)
                row = {"shape": sname, "rows": m, "fp16_us": t16 * 1e6, "fp16_timing": how16, "fp16_err": err16}
                row["fp16_tbps"] = n_out * n_in * 2 / t16 / 1e12
                for label, fam, kern, group in KERNELS:
                    ok, why = kernel_available(fam, kern, dev)
                    if not ok:
                        res["unavailable"][label] = why
                        continue
                    make = (
                        (lambda lin, k=kern: FP8Linear.from_float(lin, k))
                        if fam == "fp8"
                        else (lambda lin, k=kern, g=group: Int8Linear.from_float(lin, k, group_size=g))
                    )
                    t, how, err = one_kernel(linears(make, base), x, ref, clock)
                    row[label] = {"us": t * 1e6, "vs_fp16": t16 / t, "timing": how, "err": err}
            res["rows"].append(row)
            log.info("%s M=%d done", sname, m)
        del base
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def markdown(res: dict[str, Any]) -> str:
    c = res["ceilings"]
    labels = [k[0] for k in KERNELS if k[0] not in res["unavailable"]]
    lines = [
        f"# gpu_kernels: {res['device']} (torch {res['torch']})",
        "",
        f"ceilings on random data: copy {c['copy_tbps']:.2f} TB/s (read + write), bf16 matmul "
        f"{c['bf16_tflops']:.0f} TFLOP/s",
        "",
        "speed vs fp16 `F.linear` (x faster; us per call) and relative error vs fp64; (e): timed eagerly",
        "",
        "| shape | M | fp16 us | fp16 TB/s | " + " | ".join(labels) + " |",
        "|" + "---|" * (4 + len(labels)),
    ]
    for r in res["rows"]:
        cells = [r["shape"], str(r["rows"]), f"{r['fp16_us']:.1f}", f"{r['fp16_tbps']:.2f}"]
        for label in labels:
            k = r[label]
            mark = "" if k["timing"] == "graph" else " (e)"
            cells.append(f"{k['vs_fp16']:.2f}x ({k['us']:.1f}){mark} err {k['err']:.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    for label, why in res["unavailable"].items():
        lines.append(f"\n{label}: not run ({why})")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    p.add_argument("--rows", default="1,8,32,128", help="comma list of M (rows of the input)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per figure (default 50; --small 3)")
    a = p.parse_args(argv)
    a.rows = [int(x) for x in a.rows.split(",") if x.strip()]
    a.repeats = a.repeats or (3 if a.small else 50)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu --small")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse(argv)
    res = run(a)
    write_results(a.out, "gpu-kernels", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

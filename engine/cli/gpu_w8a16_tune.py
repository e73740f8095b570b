#!/usr/bin/env python
"""Launch configurations of the Triton W8A16 GEMM (quant/triton_w8a16.py) against fp16 ``F.linear``.

    python tools/gpu_w8a16_tune.py [--out DIR] [--budget-s 200]
    TRITON_INTERPRET=1 python tools/gpu_w8a16_tune.py --device cpu --small --rows 1,5   # smoke run

On the Llama-2-7B Linear shapes, per channel and per group of 128 and 32, at M = 1 to 64 rows: every
configuration of :data:`CONFIGS` is checked against the fp64 product of the dequantized weight (fresh
random data, NaN fails) and timed as gpu_kernels.py times kernels (a CUDA-graph pass over enough weight
copies to exceed the L2, median of ``--repeats``). The table gives each case's best configuration, the
speedup of the default (:func:`quant.triton_w8a16.config_for`) and of the best over fp16. Writes
gpu-w8a16-tune.json and .md to --out; stops starting new cases after --budget-s seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.cli.gpu_bench import write_results
from engine.cli.gpu_kernels import L2_MULTIPLE_BYTES, SHAPES, SMALL_SHAPES, Clock
from quant.int8 import dequantize_int8, dequantize_int8_groupwise, quantize_int8_groupwise, quantize_int8_rowwise

log = logging.getLogger("gpu_w8a16_tune")

# (block_n, block_k, warps) of the one-row form; (block_n, block_k, warps, stages) of the dot form
GEMV = [
    (8, 1024, 4),
    (4, 512, 2),
    (4, 1024, 2),
    (4, 2048, 4),
    (8, 2048, 4),
    (8, 2048, 8),
    (16, 1024, 8),
    (2, 1024, 1),
    (4, 1024, 4),
    (2, 2048, 2),
    (8, 512, 4),
    (16, 512, 8),
]
DOT = [
    (32, 256, 4, 3),
    (32, 128, 4, 4),
    (16, 256, 4, 3),
    (16, 512, 4, 3),
    (64, 128, 4, 4),
    (32, 256, 8, 3),
]
GROUPS: tuple[int | None, ...] = (None, 128, 32)
ROWS = (1, 4, 8, 16, 32, 64)  # --rows default


def configs(m: int) -> list[Any]:
    from quant.triton_w8a16 import Config

    gemv = [Config("gemv", n, k, w) for n, k, w in GEMV] if m == 1 else []
    return gemv + [Config("dot", n, k, w, s) for n, k, w, s in DOT]


def weights(
    n: int, k: int, group: int | None, copies: int, dev: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``copies`` random weights as (int8, scales, fp16 of the dequantized weight)."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev) * 0.02
        q, s = quantize_int8_rowwise(w) if group is None else quantize_int8_groupwise(w, group)
        wd = (
            dequantize_int8(q, s, torch.float16)
            if group is None
            else dequantize_int8_groupwise(q, s, group, torch.float16)
        )
        out.append((q, s, wd))
    return out


def one_case(ws: list, m: int, group: int | None, clock: Clock) -> dict[str, Any]:
    from triton import CompilationError
    from triton.runtime.errors import OutOfResources

    from quant.triton_w8a16 import config_for, w8a16_matmul

    n, k = ws[0][0].shape
    x = torch.randn(m, k, device=ws[0][0].device, dtype=torch.float16)
    ref = x.double() @ ws[0][2].double().t()
    t16, _ = clock(lambda: [F.linear(x, wd) for _, _, wd in ws])
    row: dict[str, Any] = {"n": n, "k": k, "rows": m, "group": group, "fp16_us": t16 / len(ws) * 1e6, "configs": {}}
    default = config_for(m, group)
    for cfg in configs(m) + ([default] if default not in configs(m) else []):
        name = f"{cfg.form} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        try:
            y = w8a16_matmul(x, ws[0][0], ws[0][1], group, cfg)
            err = float((y.double() - ref).norm() / ref.norm())
            t, how = clock(lambda c=cfg: [w8a16_matmul(x, q, s, group, c) for q, s, _ in ws])
        except (CompilationError, OutOfResources) as e:  # a configuration the compiler refuses is recorded
            row["configs"][name] = {"error": str(e).splitlines()[0][:160]}
            continue
        ok = bool(torch.isfinite(y).all()) and err <= 2e-3
        row["configs"][name] = {"us": t / len(ws) * 1e6, "err": err, "ok": ok, "timing": how, "default": cfg == default}
    return row


def run(a: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(a.device)
    clock, t0 = Clock(dev, a.repeats), time.monotonic()
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton's interpreter)"
    res: dict[str, Any] = {"device": name, "torch": torch.__version__, "rows": [], "skipped": []}
    torch.manual_seed(0)
    for m in a.rows:  # the decode row first: it is what the budget must cover
        for n, k in (SMALL_SHAPES if a.small else SHAPES).values():
            for group in GROUPS:
                if time.monotonic() - t0 > a.budget_s:
                    res["skipped"].append([n, k, m, group])
                    continue
                copies = max(2, -(-L2_MULTIPLE_BYTES // (n * k * 2))) if dev.type == "cuda" else 2
                with torch.no_grad():
                    res["rows"].append(one_case(weights(n, k, group, copies, dev), m, group, clock))
                log.info("%dx%d M=%d group=%s: %.0f s", n, k, m, group, time.monotonic() - t0)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return res


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# gpu_w8a16_tune: {res['device']} (torch {res['torch']})", "",
             "| N x K | M | group | fp16 us | default | default vs fp16 | best | best us | best vs fp16 | bad |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["rows"]:
        good = {k: v for k, v in r["configs"].items() if v.get("ok")}
        bad = [k for k, v in r["configs"].items() if not v.get("ok")]
        best = min(good, key=lambda c: good[c]["us"]) if good else "-"
        dflt = next((k for k, v in r["configs"].items() if v.get("default")), "-")
        d_us = r["configs"].get(dflt, {}).get("us", float("nan"))
        b_us = good[best]["us"] if good else float("nan")
        f16 = r["fp16_us"]
        cells = [f"{r['n']}x{r['k']}", r["rows"], r["group"] or "channel", f"{f16:.1f}", dflt, f"{f16 / d_us:.2f}x"]
        cells += [best, f"{b_us:.1f}", f"{f16 / b_us:.2f}x", len(bad)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if res["skipped"]:
        lines.append(f"\nnot run (budget): {res['skipped']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: under TRITON_INTERPRET=1")
    p.add_argument("--small", action="store_true", help="one tiny shape (a smoke run)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of M")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=200.0, help="start no new case after this many seconds")
    a = p.parse_args(argv)
    a.rows = [int(x) for x in a.rows.split(",") if x.strip()]
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu --small under TRITON_INTERPRET=1")
    res = run(a)
    write_results(a.out, "gpu-w8a16-tune", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

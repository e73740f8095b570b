#!/usr/bin/env python
"""Load and decode through the Engine on a GPU-sized random checkpoint written on the spot (no network).

    python tools/gpu_load.py [--device cuda] [--out DIR] [--shape llama3.2-1b]
    python tools/gpu_load.py --device cpu --shape small-target --out DIR     # smoke mode (CI)

Writes a Hugging Face checkpoint (fp16 safetensors on CUDA, fp32 on the CPU; a byte-level
tokenizer) under --work, then times ``Engine.from_pretrained`` on it (twice: the second
read is from the page cache) and plain greedy decoding through ``Engine.generate``
(batch 1 and 8, eager and with CUDA graphs): tokens/s and the time per decode round,
against the bytes of weights one round reads over ``--peak-tbps``.
Writes gpu-load.json and gpu-load.md to --out.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions
from engine.cli.gpu_bench import random_model, read_bytes, shape, write_results
from engine.demo.checkpoints import save_checkpoint
from engine.demo.train import train_tokenizer

log = logging.getLogger("gpu_load")

TOKENIZER_TEXT = "The quick brown fox jumps over the lazy dog.\nSpeculative decoding drafts tokens.\n" * 8


def write_checkpoint(name: str, out: Path, dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = random_model(shape(name), dtype, dev, 0)
    save_checkpoint(model, train_tokenizer(TOKENIZER_TEXT, 300), out, dtype)
    weights = read_bytes(model)
    del model
    size = sum(p.stat().st_size for p in out.iterdir())
    return {"write_s": time.perf_counter() - t0, "size_bytes": size, "round_read_bytes": weights}


def load(path: Path, dev: torch.device, dtype: torch.dtype, graphs: bool) -> tuple[Engine, float]:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng = Engine.from_pretrained(path, device=dev, dtype=dtype, kernels=KernelOptions(cuda_graphs=graphs))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return eng, time.perf_counter() - t0


def decode(eng: Engine, batch: int, prompt_len: int, new: int, vocab: int) -> float:
    """Output tokens per second of ``batch`` greedy requests of ``new`` tokens (after one warm-up call)."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(1, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_new_tokens=new, min_tokens=new)
    eng.generate(prompts, SamplingParams(max_new_tokens=8, min_tokens=8))
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / dt


def run(a: argparse.Namespace) -> dict[str, Any]:
    dev = torch.device(a.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        ckpt = Path(tmp) / "ckpt"
        res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
        res.update(shape=a.shape, dtype=str(dtype)[6:], peak_tbps=a.peak_tbps)
        res.update(write_checkpoint(a.shape, ckpt, dev, dtype))
        res["rows"] = []
        for graphs in (False, True) if dev.type == "cuda" else (False,):
            eng, first = load(ckpt, dev, dtype, graphs)
            row: dict[str, Any] = {"cuda_graphs": graphs, "load_s": first}
            del eng
            eng, row["load_again_s"] = load(ckpt, dev, dtype, graphs)
            row["memory"] = eng.stats()["memory"]
            for b in a.batches:
                tps = decode(eng, b, a.prompt_len, a.new_tokens, shape(a.shape).vocab_size)
                row[f"batch{b}_tok_s"] = tps
                row[f"batch{b}_round_ms"] = b / tps * 1e3
            res["rows"].append(row)
            del eng
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    res["floor_round_ms"] = res["round_read_bytes"] / (a.peak_tbps * 1e12) * 1e3
    return res


def markdown(res: dict[str, Any], batches: list[int]) -> str:
    lines = [
        f"# gpu_load: {res['device']}: {res['shape']} random, {res['dtype']}",
        "",
        f"checkpoint {res['size_bytes'] / 2**30:.2f} GiB written in {res['write_s']:.1f} s; one round reads "
        f"{res['round_read_bytes'] / 2**30:.2f} GiB of weights: {res['floor_round_ms']:.3f} ms at "
        f"{res['peak_tbps']} TB/s",
        "",
        "| CUDA graphs | from_pretrained s (first / again) | GiB/s | "
        + " | ".join(f"batch {b} tok/s (ms a round)" for b in batches)
        + " |",
        "|" + "---|" * (3 + len(batches)),
    ]
    for r in res["rows"]:
        cells = [str(r["cuda_graphs"]), f"{r['load_s']:.2f} / {r['load_again_s']:.2f}"]
        cells.append(f"{res['size_bytes'] / 2**30 / r['load_again_s']:.2f}")
        cells += [f"{r[f'batch{b}_tok_s']:.1f} ({r[f'batch{b}_round_ms']:.2f})" for b in batches]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shape", default="llama3.2-1b", help="a gpu_bench shape name")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    p.add_argument("--work", type=Path, default=None, help="where the checkpoint is written (default: the temp dir)")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--peak-tbps", type=float, default=4.8)
    a = p.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",") if x.strip()]
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu --shape small-target")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse(argv)
    res = run(a)
    write_results(a.out, "gpu-load", res, markdown(res, a.batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Decode-step figures of the GPU path on random weights (no checkpoint, no network).

    python tools/gpu_bench.py [--device cuda] [--out DIR] [--budget-s 200]
    python tools/gpu_bench.py --device cpu --small --out DIR      # smoke mode (tiny shapes; CI)

Target: Llama-2-7B shape (32 layers, hidden 4096, FFN 11008, vocab 32000), fp16
attention and, with ``--ffn int8``, INT8 FFN (Int8Linear, kernel w8a8: torch._int_mm;
``--ffn w8a16``: INT8 weights only, the Triton GEMM on CUDA; ``--ffn fp16``: the unquantized target,
the bandwidth roofline's case). Draft: Llama-68M
shape (2 layers, hidden 768), every Linear FP8 (kernel native: torch._scaled_mm
where the GPU has FP8 tensor cores, weight-only below). For each batch (1, 8, 32):

- the target's decode step (T = 1 after ``--context`` cached tokens), eager and
  replayed from a CUDA graph (engine/kernels/cudagraphs.py);
- verify(K) / decode step for K in 1, 2, 4, 8 (T = K + 1, graphs where available);
- the decode step's achieved bandwidth: bytes read per step (every weight but the
  embedding table, of which only B rows are read, plus the live KV cache) / time,
  against ``--peak-tbps`` (4.8 TB/s: the H200's HBM3e datasheet peak);
- the draft's step, eager and graphed, and c = draft step / target step.

Writes gpu-bench-<ffn>.json and gpu-bench-<ffn>.md to --out ($OUT or ./gpu-results). A time
budget guard skips (and lists) what would not finish within --budget-s.
"""

from __future__ import annotations

import argparse
import json
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

from engine.core.config import ModelConfig
from engine.core.forward import CachedForward, ForwardCall
from engine.core.model import KVCache, Transformer
from engine.kernels.cudagraphs import GraphedForward
from quant.linear import FP8Linear, Int8Linear
from quant.matmul_kernels import kernel_available

log = logging.getLogger("gpu_bench")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape(name: str) -> ModelConfig:
    dims = {  # hidden, intermediate, layers, heads, kv heads, vocab
        "llama2-7b": (4096, 11008, 32, 32, 32, 32000),
        "llama3.2-1b": (2048, 8192, 16, 32, 8, 128256),
        "llama-68m": (768, 3072, 2, 12, 12, 32000),
        "small-target": (64, 128, 2, 4, 2, 320),
        "small-draft": (32, 64, 1, 2, 2, 256),
    }[name]
    h, i, n, a, kv, v = dims
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=v,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=a,
        num_key_value_heads=kv,
        head_dim=h // a,
        max_position_embeddings=4096,
        eos_token_ids=[2],
    )


@torch.no_grad()
def random_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int, std: float = 0.02
) -> Transformer:
    """Random N(0, std) weights built directly on ``device`` (no CPU copy of a 7B model)."""
    with torch.device("meta"):
        m = Transformer(cfg)
    m = m.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=g)
    m.reset_rope()
    return m.eval()


def swap_linears(
    model: Transformer, make: Callable[[nn.Linear], nn.Module], names: tuple[str, ...], lm_head: bool = False
) -> None:
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for n in names:
                if hasattr(parent, n):
                    setattr(parent, n, make(getattr(parent, n)))
    if lm_head:
        model.lm_head = make(model.lm_head)


def read_bytes(model: Transformer) -> int:
    """Bytes one decode step reads of the weights: all parameters but the embedding table."""
    seen, n = {id(model.embed_tokens.weight)}, 0
    if model.lm_head.weight is model.embed_tokens.weight:
        seen.discard(id(model.embed_tokens.weight))
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


def kv_read_bytes(cfg: ModelConfig, batch: int, kv_len: int, elem: int) -> int:
    return 2 * cfg.num_hidden_layers * batch * kv_len * cfg.num_key_value_heads * cfg.head_dim * elem


class Timer:
    def __init__(self, device: torch.device, iters: int) -> None:
        self.device, self.iters = device, iters

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Median seconds of ``iters`` calls after two warm-ups."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        for _ in range(2):
            fn()
        sync()
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def step_fn(
    fwd: CachedForward,
    cfg: ModelConfig,
    batch: int,
    T: int,
    context: int,
    cache: KVCache,
    device: torch.device,
    aligned: bool,
) -> Callable[[], torch.Tensor]:
    toks = torch.randint(0, cfg.vocab_size, (batch, T), device=device)
    pos = (context + torch.arange(T, device=device)).expand(batch, T).contiguous()
    idx = torch.arange(T, device=device).expand(batch, T).contiguous()
    start = context if aligned else None  # the eager engine passes start for an aligned batch
    call = ForwardCall(toks, pos, cache, context + T, None, idx, None, start)
    return lambda: fwd.run(call).logits


@torch.no_grad()
def run(a: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    tname, dname = ("small-target", "small-draft") if a.small else ("llama2-7b", "llama-68m")
    tcfg, dcfg = shape(tname), shape(dname)
    target = random_model(tcfg, dtype, dev, 0)
    if a.ffn != "fp16":
        kern = "w8a8" if a.ffn == "int8" else "w8a16"
        swap_linears(target, lambda lin: Int8Linear.from_float(lin, kern), ("gate_proj", "up_proj", "down_proj"))
    fp8_kernel = "native" if kernel_available("fp8", "native", dev)[0] else "weight-only"
    draft = random_model(dcfg, dtype, dev, 1)
    swap_linears(draft, lambda lin: FP8Linear.from_float(lin, fp8_kernel), LINEARS, lm_head=True)
    graphs = "cuda" if cuda else "emulated (no CUDA: the static forward, eager)"
    timer = Timer(dev, a.iters)
    elem = torch.finfo(dtype).bits // 8
    w_target, w_draft = read_bytes(target), read_bytes(draft)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "target": f"{tname} random weights, attention {str(dtype)[6:]}, FFN "
        + {"int8": "int8 w8a8", "w8a16": "int8 w8a16"}.get(a.ffn, str(dtype)[6:]),
        "ffn": a.ffn,
        "draft": f"{dname} random weights, FP8 {fp8_kernel}",
        "context": a.context,
        "iters": a.iters,
        "peak_tbps": a.peak_tbps,
        "graphs": graphs,
        "target_read_bytes": w_target,
        "draft_read_bytes": w_draft,
        "rows": [],
        "skipped": [],
    }

    def over_budget(what: str) -> bool:
        if time.monotonic() - t_start > a.budget_s:
            res["skipped"].append(what)
            return True
        return False

    for B in a.batches:
        if over_budget(f"batch {B}"):
            continue
        seq = a.context + max(a.ks) + 8
        tcache = KVCache(tcfg, B, seq, dtype, dev)
        dcache = KVCache(dcfg, B, seq, dtype, dev)
        g_t = GraphedForward(target, (B,), max_tokens=max(a.ks) + 1, emulate=not cuda)
        g_d = GraphedForward(draft, (B,), max_tokens=1, emulate=not cuda, pool=g_t.pool)
        row: dict[str, Any] = {"batch": B}
        eager = timer(step_fn(target, tcfg, B, 1, a.context, tcache, dev, True))
        graph = timer(step_fn(g_t, tcfg, B, 1, a.context, tcache, dev, True))
        row.update(decode_eager_ms=eager * 1e3, decode_graph_ms=graph * 1e3, graph_speedup=eager / graph)
        best = min(eager, graph)
        moved = w_target + kv_read_bytes(tcfg, B, a.context + 1, elem)
        row.update(read_bytes=moved, achieved_tbps=moved / best / 1e12, peak_fraction=moved / best / 1e12 / a.peak_tbps)
        ratios = {}
        for k in a.ks:
            if over_budget(f"batch {B} verify K={k}"):
                break
            ratios[str(k)] = timer(step_fn(g_t, tcfg, B, k + 1, a.context, tcache, dev, True)) / graph
        row["verify_over_decode"] = ratios
        if not over_budget(f"batch {B} draft step"):
            d_eager = timer(step_fn(draft, dcfg, B, 1, a.context, dcache, dev, True))
            d_graph = timer(step_fn(g_d, dcfg, B, 1, a.context, dcache, dev, True))
            row.update(draft_eager_ms=d_eager * 1e3, draft_graph_ms=d_graph * 1e3, c=min(d_eager, d_graph) / best)
        row["capture_seconds"] = round(g_t.stats.capture_seconds + g_d.stats.capture_seconds, 3)
        row["graphs_captured"] = g_t.stats.captures + g_d.stats.captures
        res["rows"].append(row)
        del tcache, dcache, g_t, g_d
        if cuda:
            torch.cuda.empty_cache()
    res["seconds"] = round(time.monotonic() - t_start, 1)
    return res


def markdown(res: dict[str, Any]) -> str:
    ks = sorted({k for r in res["rows"] for k in r.get("verify_over_decode", {})}, key=int)
    lines = [
        f"# gpu_bench: {res['device']} (torch {res['torch']})",
        "",
        f"target: {res['target']}; draft: {res['draft']}; context {res['context']} tokens; "
        f"median of {res['iters']}; graphs: {res['graphs']}; peak {res['peak_tbps']} TB/s",
        "",
        "| batch | decode eager ms | decode graph ms | graph speedup | TB/s | of peak | "
        + " | ".join(f"verify K={k} / decode" for k in ks)
        + " | draft eager ms | draft graph ms | c | capture s |",
        "|" + "---|" * (10 + len(ks)),
    ]
    for r in res["rows"]:
        v = r.get("verify_over_decode", {})
        cells = [
            str(r["batch"]),
            f"{r['decode_eager_ms']:.3f}",
            f"{r['decode_graph_ms']:.3f}",
            f"{r['graph_speedup']:.2f}",
            f"{r['achieved_tbps']:.3f}",
            f"{100 * r['peak_fraction']:.1f}%",
        ]
        cells += [f"{v[k]:.2f}" if k in v else "-" for k in ks]
        cells += [f"{r[x]:.3f}" if x in r else "-" for x in ("draft_eager_ms", "draft_graph_ms", "c")]
        cells.append(f"{r['capture_seconds']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    if res["skipped"]:
        lines += ["", "skipped (time budget): " + ", ".join(res["skipped"])]
    lines += ["", f"{res['seconds']} s in all"]
    return "\n".join(lines) + "\n"


def write_results(out: Path, stem: str, res: dict[str, Any], md: str) -> None:
    """``stem``.json and ``stem``.md into ``out`` (created), and the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    (out / f"{stem}.md").write_text(md, encoding="utf-8")
    sys.stdout.write(md)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-results"))
    p.add_argument("--batches", default=None, help="comma list (default 1,8,32; --small 1,2)")
    p.add_argument("--ks", default=None, help="comma list of K (default 1,2,4,8; --small 1,2)")
    p.add_argument("--context", type=int, default=None, help="cached tokens before the step (default 512)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per figure (default 20)")
    p.add_argument(
        "--ffn", default="int8", choices=("int8", "w8a16", "fp16"), help="the target's FFN weights (int8: w8a8)"
    )
    p.add_argument("--peak-tbps", type=float, default=4.8, help="the bandwidth roofline (H200 datasheet: 4.8)")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip what would start after this many seconds")
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    a.batches = ints(a.batches or ("1,2" if a.small else "1,8,32"))
    a.ks = ints(a.ks or ("1,2" if a.small else "1,2,4,8"))
    a.context = a.context or (16 if a.small else 512)
    a.iters = a.iters or (3 if a.small else 20)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu --small")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse(argv)
    torch.manual_seed(0)
    res = run(a)
    write_results(a.out, f"gpu-bench-{a.ffn}", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

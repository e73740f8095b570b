"""Weight bytes per model per plan against FP16, and a small CPU kernel bench.

    python -m quant.weight_report                                  # Llama-2-7B + Llama-68M on every catalog GPU
    python -m quant.weight_report --target DIR --draft DIR --gpu a100
    python -m quant.weight_report --kernels [--m 16 --k 1024 --n 1024]   # error and CPU time of each kernel

Byte figures come from the configs (quant.memory), the same numbers the plan's
memory section holds; tests check that they equal the bytes of an applied model.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from engine.core.config import ModelConfig, load_config

from .catalog import known_gpus, lookup_gpu
from .matmul_kernels import KERNELS
from .plan import make_plan

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}
LLAMA_68M = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 2,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
}


def ideal_target_bytes(cfg: ModelConfig) -> int:
    """2 bytes per non-FFN parameter, 1 byte per FFN parameter (the issue's yardstick)."""
    ffn = 3 * cfg.hidden_size * cfg.intermediate_size * cfg.num_hidden_layers
    return 2 * (cfg.num_parameters() - ffn) + ffn


def weight_report(gpu: str, target_cfg: ModelConfig, draft_cfg: ModelConfig | None, **plan_kw: Any) -> dict[str, Any]:
    p = make_plan(lookup_gpu(gpu), target_cfg, draft_cfg, **plan_kw)
    m = p.memory
    out = {
        "gpu": p.gpu,
        "draft_kernel": p.draft.families["ffn"].kernel if p.draft else None,
        "ffn": f"{p.target.families['ffn'].storage}/{p.target.families['ffn'].kernel}",
        "target_bytes": m.target_weight_bytes,
        "target_fp16_bytes": m.target_fp16_bytes,
        "target_ratio": m.target_weight_bytes / m.target_fp16_bytes,
        "target_vs_ideal": m.target_weight_bytes / ideal_target_bytes(target_cfg),
        "max_batch": m.max_batch,
        "max_seq_len": m.max_seq_len,
    }
    if draft_cfg is not None:
        out.update(
            draft_bytes=m.draft_weight_bytes,
            draft_fp16_bytes=m.draft_fp16_bytes,
            draft_ratio=m.draft_weight_bytes / m.draft_fp16_bytes,
        )
    return out


def kernel_bench(m: int = 16, k: int = 1024, n: int = 1024, reps: int = 20, seed: int = 0) -> list[dict[str, Any]]:
    """Relative Frobenius error vs fp32 and median CPU time of each CPU-available kernel, fp32 compute."""
    from .linear import FP8Linear, Int8Linear  # local: the byte report needs no modules

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    x = torch.randn(m, k, generator=g)
    ref = lin(x)

    def timed(fn: Any) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    rows = [{"kernel": "fp32 F.linear", "rel_error": 0.0, "ms": 1e3 * timed(lambda: lin(x))}]
    with torch.no_grad():
        for (family, name), kern in KERNELS.items():
            if not kern.available("cpu")[0]:
                continue
            mod = FP8Linear.from_float(lin, name) if family == "fp8" else Int8Linear.from_float(lin, name)
            y = mod(x)
            rows.append(
                {
                    "kernel": f"{family}/{name}",
                    "rel_error": float((y - ref).norm() / ref.norm()),
                    "ms": 1e3 * timed(lambda m=mod: m(x)),
                }
            )
    base = rows[0]["ms"]
    for r in rows:
        r["x_fp32"] = r["ms"] / base
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="append", help="catalog name (repeatable); default: every catalog GPU")
    ap.add_argument("--target", help="target checkpoint dir (default: Llama-2-7B config)")
    ap.add_argument("--draft", help="draft checkpoint dir (default: Llama-68M config)")
    ap.add_argument("--int8-kernel", default="w8a8")
    ap.add_argument("--kernels", action="store_true", help="run the CPU kernel bench instead")
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1024)
    a = ap.parse_args(argv)
    if a.kernels:
        print(f"CPU kernels, x [{a.m}, {a.k}] @ W [{a.n}, {a.k}]^T, fp32 compute, {torch.get_num_threads()} threads")
        print(f"{'kernel':18} {'rel err':>9} {'ms':>9} {'x fp32':>7}")
        for r in kernel_bench(a.m, a.k, a.n):
            print(f"{r['kernel']:18} {r['rel_error']:9.2e} {r['ms']:9.3f} {r['x_fp32']:7.2f}")
        return 0
    t = load_config(a.target) if a.target else ModelConfig.from_hf_dict(LLAMA2_7B)
    d = load_config(a.draft) if a.draft else ModelConfig.from_hf_dict(LLAMA_68M)
    print(
        f"{'gpu':10} {'draft':12} {'ffn':14} {'target GB':>9} {'x fp16':>7} {'x ideal':>7} "
        f"{'draft MB':>9} {'x fp16':>7} {'batch':>5} {'seq':>5}"
    )
    for g in a.gpu or known_gpus():
        r = weight_report(g, t, d, int8_kernel=a.int8_kernel)
        print(
            f"{r['gpu']:10} {r['draft_kernel']:12} {r['ffn']:14} {r['target_bytes'] / 1e9:9.3f} "
            f"{r['target_ratio']:7.4f} {r['target_vs_ideal']:7.4f} {r['draft_bytes'] / 1e6:9.2f} "
            f"{r['draft_ratio']:7.4f} {r['max_batch']:5d} {r['max_seq_len']:5d}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

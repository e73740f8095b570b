"""An FP8 model (a draft's precision plan) on the C++ decode step (engine/kernels/cpu_fp8.py): the step holds the
dequantized weights and table, in float32 computing what the weight-only modules compute, in 16 bits close to
it; an FP8 Linear that quantizes activations (native) stays on PyTorch's ops; the tied table
and LM head share one copy; the modules' dequantizing kernel state is never made."""

from __future__ import annotations

import pytest
import torch
from util import make_checkpoint

from engine.core.checkpoint import load_model
from engine.core.forward import ForwardCall
from engine.core.model import KVCache
from engine.kernels.cpu_decode import DecodeStep, decode_step_reason, install_decode_step
from engine.kernels.cpu_gemm import small_gemm_status
from engine.kernels.memory import resident_weight_bytes
from quant.linear import FP8Embedding, FP8Linear

STATUS = small_gemm_status()
pytestmark = pytest.mark.skipif(STATUS is not None, reason=f"fp32 CPU kernels unavailable: {STATUS}")
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def fp8_model(tmp_path, kernel: str, arch: str = "llama", tied: bool = True):
    path = make_checkpoint(tmp_path / arch, arch, num_hidden_layers=2, tie_word_embeddings=tied)
    m = load_model(path, torch.float32)
    for layer in m.layers:
        for name in PROJ:
            parent, leaf = name.split(".")
            sub = getattr(layer, parent)
            setattr(sub, leaf, FP8Linear.from_float(getattr(sub, leaf), kernel))
    emb = FP8Embedding.from_float(m.embed_tokens)
    m.embed_tokens = emb
    m.lm_head = FP8Linear.tied_to(emb, kernel) if tied else FP8Linear.from_float(m.lm_head, kernel)
    return m


def logits(m, step: DecodeStep | None, toks, T0: int = 0):
    """Prompt then one more token, through ``step`` (None: the modules), on a fresh cache."""
    saved = m.layer_step
    m.use_kernels(step=step)
    cache = KVCache(m.config, toks.shape[0], 32, torch.float32, "cpu")
    try:
        with torch.no_grad():
            n = toks.shape[1] - 1
            a = m.run(ForwardCall(toks[:, :n], torch.arange(n).expand(len(toks), n), cache, n)).logits
            b = m.run(ForwardCall(toks[:, n:], torch.full((len(toks), 1), n), cache, n + 1)).logits
    finally:
        m.use_kernels(step=saved)
    return torch.cat([a, b], 1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_weight_only_fp8_runs_on_the_step(tmp_path, arch):
    m = fp8_model(tmp_path, "weight-only", arch)
    assert decode_step_reason(m) is None
    toks = torch.randint(0, m.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    want = logits(m, None, toks)
    torch.testing.assert_close(logits(m, DecodeStep(m, torch.float32), toks), want, rtol=1e-4, atol=1e-4)
    half = logits(m, DecodeStep(m, torch.float16), toks)
    assert not torch.equal(half, want)
    torch.testing.assert_close(half, want, rtol=0.02, atol=0.02)  # a draft's rounding of its weights


def test_native_fp8_stays_on_pytorch(tmp_path):
    """Native FP8 quantizes each activation row, which the step does not: a draft too keeps the plan's function
    (the acceptance a build measures is the plan's)."""
    m = fp8_model(tmp_path, "native")
    assert "quantizes activations" in decode_step_reason(m)
    assert "quantizes activations" in install_decode_step(m, "auto") and m.layer_step is None


@pytest.mark.parametrize("tied", [True, False])
def test_the_step_holds_one_copy_and_the_modules_none(tmp_path, tied):
    m = fp8_model(tmp_path, "weight-only", tied=tied)
    stored = resident_weight_bytes(m)
    assert install_decode_step(m, "auto") is None
    step = m.layer_step
    table, head = step.tensors[-3], step.tensors[-1]
    assert table.dtype == head.dtype == torch.float16 and (table is head) == tied
    toks = torch.randint(0, m.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    logits(m, step, toks)
    fp8 = [mod for mod in m.modules() if isinstance(mod, FP8Linear)]
    assert not any(mod.kernel_state for mod in fp8)  # the weight-only kernel's float32 copies never made
    copies = {t.untyped_storage().data_ptr(): t.numel() * 2 for t in step.tensors if t.dtype == torch.float16}
    assert resident_weight_bytes(m) == stored + sum(copies.values())  # e4m3 + the 16-bit copies: 3 bytes a weight

"""Small random checkpoints saved by transformers (the oracle), with a byte-level tokenizer."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    * 3
    + "Speculative decoding drafts tokens and the target verifies them in one pass. "
    "def f(x):\n    return x * 2\n" * 2
)


# token-id prompts of the identity grids (ckpt_dir's vocabulary; conftest ``plain``: their greedy outputs)
_SPREAD = [[(7 * i + j * 13) % 290 + 1 for j in range(3 + i % 9)] for i in range(20)]
# 5 and 6 repetitive: n-gram lookup has something to find
PROMPTS = [*_SPREAD[:5], [10, 11, 12, 10, 11, 12, 10, 11], _SPREAD[0] * 3, *_SPREAD[7:]]


def assert_greedy_grid(eng: Any, want: list[list[int]], *labels: Any) -> None:
    """eng's greedy outputs (40 new tokens) of PROMPTS, one and four prompts at a time, equal ``want``."""
    from engine import SamplingParams

    params = SamplingParams(max_new_tokens=40)
    for batch in (1, 4):
        outs = []
        for i in range(0, len(PROMPTS), batch):
            outs += [o.token_ids for o in eng.generate(PROMPTS[i : i + batch], params)]
        assert outs == want, (*labels, batch)


def make_tokenizer(out: Path, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    if tok.get_vocab_size() > vocab_size:  # fewer rows than the byte alphabet: keep the first vocab_size ids
        kept = {t: i for t, i in tok.get_vocab().items() if i < vocab_size}
        special = [t for t in ["<|endoftext|>"] if t in kept]
        tok = Tokenizer(models.BPE(kept, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(special)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))


def make_checkpoint(
    out: Path,
    arch: str = "llama",
    vocab_size: int = 300,
    seed: int = 0,
    perturb: float = 0.0,
    values: torch.dtype | None = None,
    **overrides,
) -> Path:
    """Save a random transformers model of the given family + tokenizer into `out`.

    perturb > 0 adds N(0, perturb) noise to every matrix after the seeded init: with the
    target's seed that gives a draft that agrees with the target often, but not always.
    values: every weight rounded to that dtype's values (saved in fp32: a bf16 checkpoint loaded in fp32).
    """
    import transformers as tf

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
        bos_token_id=None,
    )
    base.update(overrides)
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**base)).eval()
    with torch.no_grad():  # larger random weights give peaked, less tie-prone distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
        g = torch.Generator().manual_seed(seed + 1000)
        for p in model.parameters():
            if perturb and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g) * perturb)
        if values is not None:
            for p in model.parameters():
                p.copy_(p.to(values).float())
    model.save_pretrained(out)
    make_tokenizer(out, vocab_size)
    return out


def fused_gemm_count(model) -> int:
    """Fuse q/k/v and gate/up (``fuse_projections``) and return the GEMMs the model then runs: its plain
    Linears, less the 5 per layer that run inside the 2 fused groups, plus those 2 groups."""
    from torch import nn

    from engine.core.model import fuse_projections

    fuse_projections(model)
    n_lin = sum(type(m) is nn.Linear for m in model.modules())
    return n_lin - 5 * len(model.layers) + 2 * len(model.layers)


def wait_for(cond: Any, timeout: float = 10.0) -> bool:
    """Poll ``cond()`` until it is true or ``timeout`` seconds pass; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def long_prompt(e: Any, n: int) -> list[int]:
    """A prompt whose greedy continuation on ``e`` (an Engine) runs to ``n`` tokens without an eos."""
    import pytest

    from engine import SamplingParams

    for i in range(40):
        p = [(11 * i + 7 * j) % 290 + 1 for j in range(2 + i % 13)]
        if e.generate([p], SamplingParams(max_new_tokens=n))[0].finish_reason == "length":
            return p
    pytest.skip("no prompt runs to length on this random model")


GPU_PROMPTS = [[5, 17, 33, 9], [7, 7, 7, 1, 2, 3, 4, 5, 6], [40, 41], [100, 3, 3, 3, 3, 3, 3, 8, 9, 10, 11]]
GPU_GREEDY_TOKENS = 24


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain softmax(q k^T / sqrt(d)) v in fp32 with a bool mask [B|1,1,T,S]; k/v heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype)


def llama_config(**kw: Any) -> Any:
    """A Llama-2-7B ModelConfig with the config.json fields of ``kw`` replaced (planning needs no weights)."""
    from engine.core.config import ModelConfig

    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    }
    d.update(kw)
    return ModelConfig.from_hf_dict(d)


def int8_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """W8A8 ``x @ w.T`` (per-token x scales, per-channel w scales), int32 accumulate, float32 out: the reference
    the INT8 kernels are checked against."""
    from quant.int8 import int_mm, quantize_int8_rowwise

    xq, xs = quantize_int8_rowwise(x)
    wq, ws = quantize_int8_rowwise(w)
    return int_mm(xq, wq).float() * xs[:, None] * ws[None, :]


class CountedForward:
    """A ``CachedForward`` (engine/core/forward.py) that records the shape [rows, width] of each pass it runs
    through the model it wraps."""

    def __init__(self, inner: Any, packs: bool = True) -> None:
        """``packs``: False keeps the padded passes where the model would run a packed one."""
        self.inner, self.config, self._packs = inner, inner.config, packs
        self.widths: list[tuple[int, int]] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def packs(self, cache: Any) -> bool:
        return self._packs and self.inner.packs(cache)

    def run(self, call: Any) -> Any:
        self.widths.append(tuple(call.tokens.shape))
        return self.inner.run(call)

    def greedy_draft(self, call: Any, last: torch.Tensor, steps: int, vocab: int) -> torch.Tensor | None:
        self.widths.append(tuple(call.tokens.shape))
        return self.inner.greedy_draft(call, last, steps, vocab)


def assert_head_kernel_matches(head: Any, kernel: Any, scores: Any) -> None:
    """A head's C++ step (``kernel(f, e, pos, rows, cache, kv_len, last)``) against its PyTorch forward
    (``head(f, e, pos, cache, kv_len, rows)``): a ragged batch in cache rows 2 and 0, row 1 padded to the scratch
    slot, then one more entry each; ``scores(features)``: the reference logits. Outputs and caches agree."""
    g = torch.Generator().manual_seed(0)
    H = head.mcfg.hidden_size
    f, e = torch.randn(2, 6, H, generator=g), torch.randn(2, 6, H, generator=g)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 31, 31, 31]])
    rows, last = torch.tensor([2, 0]), torch.tensor([5, 2])
    caches = [head.new_cache(3, 32, torch.device("cpu")) for _ in range(2)]
    with torch.no_grad():
        ref = head(f, e, pos, caches[0], 8, rows)[torch.arange(2), last]
        logits, out = kernel(f, e, pos, rows, caches[1], 8, last)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, scores(ref), rtol=1e-4, atol=1e-4)
        nxt = torch.tensor([[6], [3]])
        ref2 = head(ref[:, None], e[:, :1], nxt, caches[0], 8, rows)[:, 0]
        _, out2 = kernel(ref[:, None], e[:, :1], nxt, rows, caches[1], 8, torch.zeros(2, dtype=torch.long))
        torch.testing.assert_close(out2, ref2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(caches[1].k[:, [2, 0]], caches[0].k[:, [2, 0]], rtol=1e-4, atol=1e-5)


def joint3_counts(eng: Any, prompt: list[int], sp: Any, passes: int) -> Any:
    """Counts [V**3] of the first 3 output tokens over ``passes`` x 4000 requests of ``prompt``."""
    import numpy as np

    V, counts = eng.vocab, np.zeros(eng.vocab**3)
    for _ in range(passes):
        for o in eng.generate([prompt] * 4000, sp):
            t = o.token_ids
            counts[(t[0] * V + t[1]) * V + t[2]] += 1
    return counts


def assert_step_like_pytorch(m: Any, ref: Any) -> None:
    """``m`` (its decode step installed) against ``ref`` (the same weights on PyTorch): a 9-token prefill of 2 rows
    within fp32 tolerance, and a verify block of 4 tokens equal to its 4 one-token steps bit for bit."""
    from engine.core.model import KVCache

    toks = torch.randint(0, m.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    c1, c2 = (KVCache(m.config, 2, 32, torch.float32, "cpu") for _ in range(2))
    with torch.no_grad():
        assert torch.allclose(m(toks, cache=c1, kv_len=9), ref(toks, cache=c2, kv_len=9), rtol=1e-4, atol=1e-4)
        nxt = torch.randint(0, m.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(9, 13).expand(2, 4)
        c2.k.copy_(c1.k)
        c2.v.copy_(c1.v)
        block = m(nxt, input_pos=pos, cache=c1, kv_len=13)
        steps = [m(nxt[:, t : t + 1], input_pos=pos[:, t : t + 1], cache=c2, kv_len=10 + t) for t in range(4)]
    assert torch.equal(block, torch.cat(steps, 1))

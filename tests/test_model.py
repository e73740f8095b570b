"""The model against transformers (the oracle), and the KV cache against recomputation."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from util import make_checkpoint

from engine import Engine, SamplingParams
from engine.core.checkpoint import load_model
from engine.core.model import KVCache, fuse_projections

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "llama-gqa-tied-llama3rope": (
        "llama",
        dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    ),
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-linear-rope-bias": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True)),
    "mistral-sliding-window": ("mistral", dict(num_key_value_heads=1, sliding_window=24)),
    "qwen2-qkv-bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
}
HF = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, over = CASES[request.param]
    d = make_checkpoint(tmp_path_factory.mktemp(request.param), arch, **over)
    return arch, d


@pytest.mark.parametrize("fused", [False, True])
def test_logits_match_transformers(case, fused):
    arch, d = case
    theirs_model = HF[arch].from_pretrained(d, dtype=torch.float32).eval()
    ours = load_model(d, torch.float32)
    if fused:  # q/k/v and gate/up as one GEMM each (what the Engine runs)
        assert fuse_projections(ours) == 2 * ours.config.num_hidden_layers
        assert ours.layers[0].self_attn.q_proj.weight.data_ptr() == ours.layers[0].self_attn.qkv.weight.data_ptr()
    x = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = theirs_model(x).logits
        mine = ours(x)
    rel = ((mine - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= 1e-4, rel


@pytest.mark.parametrize("fused", [False, True])
def test_cached_forward_matches_full_forward(case, fused):
    _, d = case
    m = load_model(d, torch.float32)
    if fused:
        fuse_projections(m)
    x = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    full = m(x)
    cache = KVCache(m.config, 3, 64, torch.float32, "cpu")
    pos = torch.arange(40).expand(3, 40)
    parts = [m(x[:, a:b], pos[:, a:b], cache, b) for a, b in [(0, 17), (17, 18), (18, 31), (31, 40)]]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)


def _recompute_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("batch", [1, 3])
def test_kv_cache_decoding_equals_recompute(ckpt_dir, batch):
    eng = Engine.from_pretrained(ckpt_dir)
    prompts = [[7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38]][:batch]
    eos_free = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_new_tokens=64))]
    for p, got in zip(prompts, eos_free):
        ref = _recompute_greedy(eng.target, p, len(got))
        assert got == ref
        if len(got) < 64:  # stopped on eos: the reference's last token is eos too
            assert got[-1] in eng.config.eos_token_ids


def test_greedy_equals_transformers_generate(ckpt_dir):
    hf = tf.LlamaForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    eng = Engine.from_pretrained(ckpt_dir)
    for p in ([5, 6, 7, 8], [100, 3, 250, 17, 9, 42]):
        out = eng.generate([p], SamplingParams(max_new_tokens=64))[0]
        ref = hf.generate(
            torch.tensor([p]),
            max_new_tokens=64,
            do_sample=False,
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
        )[0, len(p) :].tolist()
        assert out.token_ids == ref[: len(out.token_ids)]
        assert len(out.token_ids) == len(ref)

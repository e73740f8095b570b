"""The fp32 decode-step kernel (engine/kernels/cpu_decode.py) against the model's PyTorch forward (its fallback,
same inputs and outputs): logits and KV cache on ragged, padded, re-rowed calls for Llama (GQA), Qwen2
(q/k/v bias) and Mistral (sliding window); a block of tokens equals one-token steps bit for bit; refusals
name the reason; the engine's greedy output is unchanged by it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from util import make_checkpoint

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, SpeculationConfig
from engine.core.attention import math_attention, sdpa_attention
from engine.core.checkpoint import load_model
from engine.core.errors import InvalidConfigError, KernelUnavailableError
from engine.core.forward import Features, ForwardCall
from engine.core.model import KVCache, fuse_projections
from engine.kernels.cpu_decode import (
    DecodeStep,
    decode_step_reason,
    exact_weight_dtype,
    install_decode_step,
)
from engine.kernels.cpu_gemm import small_gemm_status
from engine.kernels.cpu_linear import small_gemm_linears

STATUS = small_gemm_status()
pytestmark = pytest.mark.skipif(STATUS is not None, reason=f"fp32 CPU kernels unavailable: {STATUS}")

ARCHS = {"llama": {}, "qwen2": {"hidden_size": 48}, "mistral": {"sliding_window": 6}}  # qwen2: head_dim 12


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request, tmp_path_factory):
    arch = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(arch), arch, num_hidden_layers=3, **ARCHS[arch])
    m = load_model(path, torch.float32)
    fuse_projections(m)
    small_gemm_linears(m)  # as the engine sets up its fp32 target (the LM head on the row-independent kernel)
    assert install_decode_step(m) is None and isinstance(m.layer_step, DecodeStep)
    return m


def _prefilled(m, B: int, S: int = 64, n: int = 12, seed: int = 0) -> KVCache:
    cache = KVCache(m.config, B, S, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    step, m.layer_step = m.layer_step, None
    with torch.no_grad():
        m(torch.randint(0, m.config.vocab_size, (B, n), generator=g), cache=cache, kv_len=n)
    m.layer_step = step
    return cache


def _both(m, *args, **kw):
    """(kernel logits, PyTorch logits, kernel cache, PyTorch cache) of the same call on equal caches."""
    c1, c2 = kw.pop("cache"), kw.pop("cache_ref")
    with torch.no_grad():
        got = m(*args, cache=c1, **kw)
        step, m.layer_step = m.layer_step, None
        try:
            want = m(*args, cache=c2, **kw)
        finally:
            m.layer_step = step
    return got, want


def _both_runs(m, call: ForwardCall, cache_ref: KVCache):
    """(kernel ForwardOut, PyTorch ForwardOut) of the same call on equal caches (``call.cache``, ``cache_ref``)."""
    with torch.no_grad():
        got = m.run(call)
        step, m.layer_step = m.layer_step, None
        try:
            want = m.run(dataclasses.replace(call, cache=cache_ref))
        finally:
            m.layer_step = step
    return (got.logits, got.features), (want.logits, want.features)


def test_ragged_padded_rerowed_call_matches_the_pytorch_layers(model):
    B, S = 3, 64
    c1, c2 = _prefilled(model, B, S), _prefilled(model, B, S)
    lens = [12, 9, 11]  # each row's next position (rows 1 and 2 re-decode positions they hold)
    T = 4
    toks = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    pos = torch.full((B, T), S - 1)  # padding goes to the scratch slot, as the decode loop does
    real = [4, 2, 3]
    for b in range(B):
        pos[b, : real[b]] = torch.arange(lens[b], lens[b] + real[b])
    rows = torch.tensor([2, 0, 1])
    kv_len = max(n + r for n, r in zip(lens, real))
    idx = torch.tensor([[0, 3], [0, 1], [1, 2]])
    got, want = _both(model, toks, pos, kv_len=kv_len, rows=rows, logits_idx=idx, cache=c1, cache_ref=c2)
    assert got.shape == want.shape == (B, 2, model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c1.k, c2.k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c1.v, c2.v, rtol=1e-4, atol=1e-5)
    assert not torch.equal(c1.k[:, :, :, lens[0] + 3], torch.zeros_like(c1.k[:, :, :, 0]))  # it wrote


def test_hidden_states_of_the_scored_rows_match(model):
    """features=SCORED (the draft heads' features): the final-norm outputs of the scored rows, [B, J, H]."""
    B, S = 2, 64
    c1, c2 = _prefilled(model, B, S), _prefilled(model, B, S)
    toks = torch.tensor([[5, 6, 7], [8, 9, 10]])
    pos = torch.tensor([[12, 13, 14], [12, 13, S - 1]])
    idx = torch.tensor([[0, 2], [0, 1]])
    call = ForwardCall(toks, pos, c1, kv_len=15, logits_idx=idx, features=Features.SCORED)
    (got, h), (want, h_ref) = _both_runs(model, call, c2)
    assert h.shape == h_ref.shape == (B, 2, model.config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("features", [Features.SCORED, Features.ALL])
def test_feature_layers_are_the_layer_inputs_of_the_pytorch_layers(model, features):
    """EAGLE-3's features on the kernel: the hidden states entering the chosen layers, concatenated in the
    order asked (a layer twice, the first layer's input = the embedding), of the scored rows or of every row."""
    B, S = 2, 64
    c1, c2 = _prefilled(model, B, S), _prefilled(model, B, S)
    toks = torch.tensor([[5, 6, 7], [8, 9, 10]])
    pos = torch.tensor([[12, 13, 14], [12, 13, S - 1]])
    idx = torch.tensor([[0, 2], [0, 1]])
    layers = (2, 0, 2)
    model.use_feature_layers(layers)
    try:
        call = ForwardCall(toks, pos, c1, kv_len=15, logits_idx=idx, features=features)
        (got, h), (want, h_ref) = _both_runs(model, call, c2)
    finally:
        model.use_feature_layers(())
    H = model.config.hidden_size
    assert h.shape == h_ref.shape == ((B, 2, 3 * H) if features is Features.SCORED else (B, 3, 3 * H))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
    scored = toks if features is Features.ALL else toks.gather(1, idx)
    torch.testing.assert_close(h[..., H : 2 * H], model.embed_tokens(scored))
    torch.testing.assert_close(h[..., :H], h[..., 2 * H :], rtol=0, atol=0)


def test_the_last_layers_output_and_refused_feature_layers(model):
    """aux = n_layers: the last layer's output before the final norm (normed, the final-norm features); an aux
    layer past it, or a wide-first-layer call on this model, is refused before the cache is written."""
    B, S = 1, 64
    cache = _prefilled(model, B, S)
    step, L = model.layer_step, model.config.num_hidden_layers
    toks, pos, idx = torch.tensor([[5, 6]]), torch.tensor([[12, 13]]), torch.tensor([1])
    cos, sin = model.rope_table(S, torch.float32)
    e, eb = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool)

    def call(aux, h):
        return step.impl.forward(toks, pos, e, idx, 14, L, cache.k, cache.v, cos, sin, h, e, eb, aux, False)

    g, normed = torch.empty(1), torch.empty(1)
    call(torch.tensor([L]), g)
    call(e, normed)
    torch.testing.assert_close(model.norm(g), normed, rtol=1e-5, atol=1e-5)
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match="an aux layer is not in 0.."):
        call(torch.tensor([L + 1]), torch.empty(1))
    assert torch.equal(cache.k, before)
    with pytest.raises(RuntimeError, match="first layer reads H columns"):
        x = torch.zeros(1, 2, 2 * model.config.hidden_size)
        h = x[..., : model.config.hidden_size]
        step.impl.forward_pair(x, h, pos, e, idx, 14, cache.k, cache.v, cos, sin, g, e, e, e)


def test_early_exit_layers_and_start_path_match(model):
    c1, c2 = _prefilled(model, 2), _prefilled(model, 2)
    toks = torch.tensor([[5], [7]])
    pos = torch.full((2, 1), 12)
    got, want = _both(model, toks, pos, kv_len=13, n_layers=1, start=12, cache=c1, cache_ref=c2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c1.k[:1], c2.k[:1], rtol=1e-4, atol=1e-5)
    assert torch.equal(c1.k[1:, :, :, 12], torch.zeros_like(c1.k[1:, :, :, 12]))  # later layers untouched


def test_greedy_drafting_in_one_call_equals_the_step_loop(model):
    """DecodeStep.greedy == a forward at `last`, then one-token forwards on each argmax (ragged, re-rowed,
    a vocabulary cut, n_layers): the same ids and the same caches."""
    B, S, k, V = 3, 64, 5, model.config.vocab_size - 3
    c1, c2 = _prefilled(model, B, S), _prefilled(model, B, S)
    toks = torch.randint(0, model.config.vocab_size, (B, 3), generator=torch.Generator().manual_seed(6))
    pos = torch.full((B, 3), S - 1)
    lens, real = [12, 10, 11], [3, 1, 2]
    for b in range(B):
        pos[b, : real[b]] = torch.arange(lens[b], lens[b] + real[b])
    rows, last = torch.tensor([1, 2, 0]), torch.tensor(real) - 1
    kv_len = max(n + r for n, r in zip(lens, real))
    step = model.layer_step
    for n_layers in (None, 1):
        with torch.no_grad():
            got = step.greedy(ForwardCall(toks, pos, c1, kv_len, rows, n_layers=n_layers), last, k, V)
            logits, want = step.run(ForwardCall(toks, pos, c2, kv_len, rows, last, n_layers)).logits, []
            nxt = torch.tensor([n + r for n, r in zip(lens, real)])
            for i in range(k):
                want.append(logits[:, :V].argmax(-1))
                if i + 1 < k:
                    one = ForwardCall(
                        want[-1][:, None], (nxt + i)[:, None], c2, kv_len + i + 1, rows,
                        torch.zeros(B, dtype=torch.long), n_layers,
                    )  # fmt: skip
                    logits = step.run(one).logits
        assert torch.equal(got, torch.stack(want, 1)) and got.shape == (B, k)
        assert torch.equal(c1.k, c2.k) and torch.equal(c1.v, c2.v)
    with pytest.raises(RuntimeError, match="greedy: steps >= 1"):
        step.greedy(ForwardCall(toks, pos, c1, kv_len, rows), last, 0, V)


def test_a_block_equals_one_token_steps_bit_for_bit(model):
    T = 6  # longer than the Mistral window: the window applies inside the block too
    toks = torch.randint(0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(12, 12 + T).expand(2, T)
    block_cache, step_cache = _prefilled(model, 2), _prefilled(model, 2)
    with torch.no_grad():
        block = model(toks, pos, block_cache, 12 + T)
        steps = torch.cat([model(toks[:, i : i + 1], pos[:, i : i + 1], step_cache, 13 + i) for i in range(T)], 1)
    assert torch.equal(block, steps)
    assert torch.equal(block_cache.k, step_cache.k) and torch.equal(block_cache.v, step_cache.v)


def test_a_prefill_with_other_rows_decoding_leaves_their_rows_unchanged(model):
    """A step that carries a new prompt (many rows) beside another sequence's one token: that token's
    logits are bit for bit those of its step alone (every cached forward takes the same path)."""
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), generator=g)
    tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=g)
    alone, mixed = _prefilled(model, 2), _prefilled(model, 2)
    with torch.no_grad():
        want = model(tok, torch.tensor([[12]]), alone, 13, rows=torch.tensor([1]))[:, 0]
        toks = torch.cat([torch.cat([tok, torch.zeros(1, 39, dtype=torch.long)], 1), prompt])
        pos = torch.cat([torch.tensor([[12] + [63] * 39]), torch.arange(40)[None]])  # row 1 pads to scratch
        got = model(toks, pos, mixed, 40, rows=torch.tensor([1, 0]))[:1, 0]
    assert torch.equal(got, want)


def test_autograd_and_other_cache_dtypes_go_to_the_pytorch_forward(model):
    step = model.layer_step
    x = torch.zeros(1, 100, dtype=torch.long)
    cache = KVCache(model.config, 1, 64, torch.float32, "cpu")
    assert step.takes(ForwardCall(x, cache=cache))
    with torch.enable_grad():
        model.norm.weight.requires_grad_(True)
        try:
            assert not step.takes(ForwardCall(x[:, :1], cache=cache))  # training: autograd needs the PyTorch ops
        finally:
            model.norm.weight.requires_grad_(False)
    half = KVCache(model.config, 1, 64, torch.bfloat16, "cpu")
    assert not step.takes(ForwardCall(x[:, :1], cache=half))


def test_refusals_name_the_reason(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama")
    m = load_model(path, torch.float32)
    assert "not fused" in decode_step_reason(m)  # before fuse_projections
    fuse_projections(m)
    m.attn_fn = math_attention
    assert "attention backend" in decode_step_reason(m)
    with pytest.raises(KernelUnavailableError, match="attention backend"):
        DecodeStep(m)
    m.attn_fn = sdpa_attention

    class Int8Like(torch.nn.Module):  # stands for a quantized module swap
        weight = torch.zeros(1)

    m.layers[1].mlp.down_proj = Int8Like()
    assert decode_step_reason(m) == "layer 1 down_proj is Int8Like, not a plain fp32 projection"
    bf = load_model(path, torch.bfloat16)
    fuse_projections(bf)
    assert "float32" in install_decode_step(bf) and bf.layer_step is None


@pytest.mark.parametrize("drafter", ["model", "early-exit"])
def test_engine_greedy_output_is_the_same_with_and_without_it(ckpt_dir, draft_dir, drafter):
    prompts = ["abc", "hello world", "the cat sat on"]
    sp = SamplingParams(max_new_tokens=24)
    outs = {}
    for pack in (None, False):
        eng = Engine.from_pretrained(
            ckpt_dir,
            draft_dir if drafter == "model" else None,
            speculation=SpeculationConfig(drafter=drafter, k=4, k_policy="constant"),
            kernels=KernelOptions(cpu_pack=pack),
        )
        want = ["target", "draft"] if drafter == "model" else ["target"]
        assert eng.info["cpu_decode_step"] == (want if pack is None else [])
        assert eng.info["draft_step_weights"] == ("float16" if pack is None and drafter == "model" else None)
        assert eng.info["target_step_weights"] == ("float32" if pack is None else None)  # random fp32 weights
        outs[pack] = [o.token_ids for o in eng.generate(prompts, sp)]
    plain = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=False))
    assert outs[None] == outs[False] == [o.token_ids for o in plain.generate(prompts, sp)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_weights_widen_exactly(tmp_path, dtype):
    """With weights that fp16 / bf16 hold exactly, 16-bit storage gives the fp32 kernel's logits bit for
    bit (the widening is exact and the arithmetic is the same fp32); on the raw weights it stays close.
    exact_weight_dtype finds the narrowest exact storage (and install_decode_step uses it by default)."""
    path = make_checkpoint(tmp_path / "m", "qwen2", num_hidden_layers=2)
    m = load_model(path, torch.float32)
    fuse_projections(m)
    toks = torch.randint(0, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(5).expand(2, 5)

    def logits(dtype):  # (the AVX-512 kernel: AMX tiles add up in another order, tests/test_amx_gemm.py)
        cache = KVCache(m.config, 2, 32, torch.float32, "cpu")
        with torch.no_grad():
            return DecodeStep(m, dtype, amx=False).run(ForwardCall(toks, pos, cache, 5)).logits

    raw32, raw16 = logits(torch.float32), logits(dtype)
    assert not torch.equal(raw32, raw16)
    torch.testing.assert_close(raw16, raw32, rtol=0.05, atol=0.05)
    assert exact_weight_dtype(m) == torch.float32
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(dtype).float())
    assert torch.equal(logits(dtype), logits(torch.float32))
    # (bf16 values inside fp16's range are fp16 values too: bf16 is tried first)
    assert exact_weight_dtype(m) == dtype
    assert install_decode_step(m) is None and m.layer_step.weight_dtype == dtype
    with pytest.raises(ValueError, match="weight_dtype=torch.float64 is invalid: allowed torch.float32"):
        DecodeStep(m, torch.float64)


def test_draft_step_weights_is_validated(ckpt_dir, draft_dir):
    with pytest.raises(
        InvalidConfigError, match="kernels.draft_step_weights='int8' is invalid: allowed float16, bfloat16, float32"
    ):
        Engine.from_pretrained(ckpt_dir, draft_dir, kernels=KernelOptions(draft_step_weights="int8"))
    for name in ("float32", "bfloat16"):
        eng = Engine.from_pretrained(ckpt_dir, draft_dir, kernels=KernelOptions(draft_step_weights=name))
        assert eng.info["draft_step_weights"] == name


@pytest.mark.parametrize("arch, extra", [("llama", {}), ("mistral", {"sliding_window": 16})])
def test_heads_of_64_attend_as_query_tiles_with_the_bits_of_one_token_steps(arch, extra, tmp_path):
    """With head_dim 64 the rows of one sequence and head attend as tiles of up to 4 queries that share each key and
    value read (csrc/attention.cpp; rows with another first key under a sliding window are not tiled together): a
    block of 7 tokens for two sequences equals the one-token steps bit for bit, and PyTorch's forward within
    tolerance."""
    path = make_checkpoint(tmp_path, arch, num_hidden_layers=2, hidden_size=256, **extra)  # 4 heads of 64
    m = load_model(path, torch.float32)
    fuse_projections(m)
    small_gemm_linears(m)
    assert install_decode_step(m) is None and m.config.head_dim == 64
    T = 7  # tiles of 4 and 3 (the window: a tile of the 4 rows whose first key is 0, then single rows)
    toks = torch.randint(0, m.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(12, 12 + T).expand(2, T)
    block_cache, step_cache, ref_cache = _prefilled(m, 2), _prefilled(m, 2), _prefilled(m, 2)
    with torch.no_grad():
        block = m(toks, pos, block_cache, 12 + T)
        steps = torch.cat([m(toks[:, i : i + 1], pos[:, i : i + 1], step_cache, 13 + i) for i in range(T)], 1)
        step, m.layer_step = m.layer_step, None
        ref = m(toks, pos, ref_cache, 12 + T)
        m.layer_step = step
    assert torch.equal(block, steps)
    torch.testing.assert_close(block, ref, rtol=1e-4, atol=1e-4)

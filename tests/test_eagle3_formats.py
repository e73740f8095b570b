"""EAGLE-3 heads loaded from the layouts users have (engine/spec_decode/heads/eagle3_formats.py): synthetic
checkpoints with the real key names in the EAGLE authors' / SpecForge layout (safetensors and pytorch_model.bin)
and in vLLM speculators', scored like a reference written here in plain torch over the same state dict; heads
that do not fit the target are refused naming both values; the target's captured layers are the hidden states
entering them (transformers' ``output_hidden_states``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.core.checkpoint import load_model
from engine.core.errors import DraftMismatchError
from engine.core.forward import Features, ForwardCall
from engine.core.tokenizer import Tokenizer
from engine.spec_decode.heads.checkpoint import load_head
from engine.spec_decode.heads.eagle3 import Eagle3Head

NH, NKV, HD, INTER, EPS, THETA = 2, 1, 32, 96, 1e-5, 5000.0  # the head's own shape (not the target's 4/2/16)


def synthetic_state(H: int, V: int, draft_vocab: int, seed: int, fc_bias=False, embed=False) -> dict:
    """Random weights under the EAGLE authors' names, with a d2t / t2d of ``draft_vocab`` random target ids."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    ids = torch.randperm(V, generator=g)[:draft_vocab].sort().values
    sd = {
        "fc.weight": r(H, 3 * H),
        "midlayer.input_layernorm.weight": 1 + 0.1 * r(H),
        "midlayer.hidden_norm.weight": 1 + 0.1 * r(H),
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * r(H),
        "midlayer.self_attn.q_proj.weight": r(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, NH * HD),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "norm.weight": 1 + 0.1 * r(H),
        "lm_head.weight": 4 * r(draft_vocab, H),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if fc_bias:
        sd["fc.bias"] = r(H)
    if embed:
        sd["embed_tokens.weight"] = r(V, H)
    return sd


def llama_layer_config(H: int, V: int, draft_vocab: int, **extra) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "max_position_embeddings": 2048,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        **extra,
    }


def write_layout(out: Path, layout: str, sd: dict, H: int, V: int, draft_vocab: int, **cfg) -> Path:
    """``sd`` (authors' names) written as ``layout``: "authors" (model.safetensors), "authors-bin"
    (pytorch_model.bin) or "speculators" (its config, ``layers.0.*`` names)."""
    out.mkdir(parents=True, exist_ok=True)
    aux = cfg.pop("aux", None)
    if layout == "speculators":
        raw = {
            "speculators_model_type": "eagle3",
            "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": llama_layer_config(H, V, draft_vocab),
            "draft_vocab_size": draft_vocab,
            "norm_before_residual": cfg.pop("norm_before_residual", False),
            "target_hidden_size": cfg.pop("target_hidden_size", H),
            "eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": "test/tiny-llama", "architectures": ["LlamaForCausalLM"]},
            },
            **cfg,
        }
        sd = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    else:
        raw = {"architectures": ["LlamaForCausalLMEagle3"], **llama_layer_config(H, V, draft_vocab), **cfg}
    (out / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    if layout == "authors-bin":
        torch.save(sd, out / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    return out


def reference_logits(sd: dict, feats: torch.Tensor, emb: torch.Tensor, V: int, norm_before=False) -> torch.Tensor:
    """EAGLE-3's head over T entries (causal, positions 0..T-1), written out: logits over the target's vocabulary
    [T, V], -inf outside the draft vocabulary."""

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    def lin(name, x):
        return x @ sd[name].T

    T = feats.shape[0]
    h = lin("fc.weight", feats) + sd.get("fc.bias", 0)
    hn = rms(h, sd["midlayer.hidden_norm.weight"])
    res = hn if norm_before else h
    x = torch.cat([rms(emb, sd["midlayer.input_layernorm.weight"]), hn], -1)
    q = lin("midlayer.self_attn.q_proj.weight", x).view(T, NH, HD).transpose(0, 1)
    k = lin("midlayer.self_attn.k_proj.weight", x).view(T, NKV, HD).transpose(0, 1)
    v = lin("midlayer.self_attn.v_proj.weight", x).view(T, NKV, HD).transpose(0, 1)
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2).float() / HD)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(t):
        return t * cos + torch.cat([-t[..., HD // 2 :], t[..., : HD // 2]], -1) * sin

    q, k = rot(q), rot(k).repeat_interleave(NH // NKV, 0)
    v = v.repeat_interleave(NH // NKV, 0)
    att = (q @ k.transpose(1, 2)) / math.sqrt(HD) + torch.full((T, T), float("-inf")).triu(1)
    o = (att.softmax(-1) @ v).transpose(0, 1).reshape(T, NH * HD)
    h2 = res + lin("midlayer.self_attn.o_proj.weight", o)
    m = rms(h2, sd["midlayer.post_attention_layernorm.weight"])
    h3 = h2 + lin(
        "midlayer.mlp.down_proj.weight",
        F.silu(lin("midlayer.mlp.gate_proj.weight", m)) * lin("midlayer.mlp.up_proj.weight", m),
    )
    logits = lin("lm_head.weight", rms(h3, sd["norm.weight"]))
    full = torch.full((T, V), float("-inf"))
    full[:, torch.arange(len(sd["d2t"])) + sd["d2t"]] = logits
    return full


def head_logits(head: Eagle3Head, vocab_ids: torch.Tensor, feats: torch.Tensor, emb: torch.Tensor, V: int):
    """The loaded head over the same entries, through its KV cache, mapped to the target's vocabulary."""
    T = feats.shape[0]
    cache = head.new_cache(1, T + 4, torch.device("cpu"))
    with torch.no_grad():
        g = head(head.fuse(feats)[None], emb[None], torch.arange(T)[None], cache, T)
        full = torch.full((T, V), float("-inf"))
        full[:, vocab_ids] = head.logits(g)[0]
    return full


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return load_model(ckpt_dir, torch.float32, "cpu"), Tokenizer(ckpt_dir).vocab()


CASES = {
    "authors": ("authors", {}, {}),
    "authors-bin": ("authors-bin", {}, {}),
    "specforge-embed": ("authors", {"embed": True}, {}),
    "authors-aux-layers": ("authors", {}, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 2]}}),
    "speculators": ("speculators", {"fc_bias": True}, {"aux": [0, 1, 3]}),
    "speculators-norm-before": ("speculators", {}, {"norm_before_residual": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_published_layout_scores_like_the_reference(target, tmp_path, case):
    model, vocab = target
    layout, sd_kw, cfg_kw = CASES[case]
    H, V, n = model.config.hidden_size, model.config.vocab_size, 120
    sd = synthetic_state(H, V, n, seed=len(case), **sd_kw)
    path = write_layout(tmp_path / case, layout, sd, H, V, n, **dict(cfg_kw))
    head, cfg, vocab_ids = load_head(path, model, vocab, "eagle3")
    assert isinstance(head, Eagle3Head) and cfg.kind == "eagle3" and cfg.draft_vocab == n
    aux = cfg_kw.get("aux") or cfg_kw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    assert cfg.feature_layers == tuple(aux or (2, 2, 1))  # default: 2, L // 2, L - 3 of the 4-layer target
    assert (head.embed_tokens is not None) == sd_kw.get("embed", False)
    g = torch.Generator().manual_seed(1)
    feats, emb = torch.randn(9, 3 * H, generator=g), torch.randn(9, H, generator=g)
    want = reference_logits(sd, feats, emb, V, cfg_kw.get("norm_before_residual", False))
    got = head_logits(head, vocab_ids, feats, emb, V)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got[:, 0] == float("-inf")).all() == (not bool(sd["t2d"][0]))


def _authors(tmp_path, model, **cfg):
    H, V = model.config.hidden_size, model.config.vocab_size
    return write_layout(tmp_path / "h", "authors", synthetic_state(H, V, 50, 0), H, V, 50, **cfg)


@pytest.mark.parametrize(
    ("layout", "cfg", "message"),
    [
        ("authors", {"hidden_size": 32}, "hidden_size 32 != the target's 64"),
        ("authors", {"vocab_size": 299}, "vocab_size 299 != the target's 300"),
        ("authors", {"target_hidden_size": 128}, "target_hidden_size 128 != the target's 64"),
        ("speculators", {"aux": [1, 2, 9]}, "more than 9 layers; the target has 4"),
    ],
)
def test_a_head_for_another_verifier_is_refused_naming_both(target, tmp_path, layout, cfg, message):
    model, vocab = target
    H, V = model.config.hidden_size, model.config.vocab_size
    raw = dict(cfg)
    hidden, vsize = raw.pop("hidden_size", H), raw.pop("vocab_size", V)
    sd = synthetic_state(hidden, vsize, 50, 0)
    path = write_layout(tmp_path / "h", layout, sd, hidden, vsize, 50, **raw)
    with pytest.raises(DraftMismatchError, match=message):
        load_head(path, model, vocab, "eagle3")


def test_bad_vocabulary_maps_and_shapes_are_refused(target, tmp_path):
    model, vocab = target
    H, V = model.config.hidden_size, model.config.vocab_size
    sd = synthetic_state(H, V, 50, 0)
    sd["d2t"] = sd["d2t"] + V  # maps outside the target's vocabulary
    with pytest.raises(DraftMismatchError, match="d2t maps draft ids outside 0..299"):
        load_head(write_layout(tmp_path / "a", "authors", sd, H, V, 50), model, vocab, "eagle3")
    sd = synthetic_state(H, V, 50, 0)
    sd["t2d"] = torch.ones(V, dtype=torch.bool)
    with pytest.raises(DraftMismatchError, match="t2d .* disagrees with d2t"):
        load_head(write_layout(tmp_path / "b", "authors", sd, H, V, 50), model, vocab, "eagle3")
    sd = synthetic_state(H, V, 50, 0)
    sd["midlayer.self_attn.q_proj.weight"] = sd["midlayer.self_attn.q_proj.weight"][:, :H]  # 1H in, not 2H
    with pytest.raises(DraftMismatchError, match=r"midlayer.self_attn.q_proj.weight has shape \(64, 64\)"):
        load_head(write_layout(tmp_path / "c", "authors", sd, H, V, 50), model, vocab, "eagle3")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(Exception, match="allowed an EAGLE-3 head"):
        load_head(tmp_path / "d", model, vocab, "eagle3")


def test_feature_layers_are_the_hidden_states_entering_them(ckpt_dir, target):
    """``use_feature_layers``: transformers' hidden_states[i] (the input of layer i), in the given order, in the
    same pass as the logits (uncached and through the cache, at the scored positions)."""
    import transformers as tf

    from engine.core.forward import KVCache

    model, _ = target
    hf = tf.AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
    tokens = torch.tensor([[5, 17, 99, 3, 250, 41, 7]])
    with torch.no_grad():
        hs = hf(tokens, output_hidden_states=True).hidden_states
        plain = model.run(ForwardCall(tokens)).logits
        model.use_feature_layers((3, 0, 2))
        try:
            out = model.run(ForwardCall(tokens, features=Features.ALL))
            cache = KVCache(model.config, 1, 16, torch.float32, "cpu")
            idx = torch.tensor([[4, 6]])
            cached = model.run(ForwardCall(tokens, None, cache, 7, None, idx, features=Features.SCORED))
        finally:
            model.use_feature_layers(())
    want = torch.cat([hs[3], hs[0], hs[2]], -1)
    torch.testing.assert_close(out.features, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.logits, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached.features, want[:, [4, 6]], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cached.logits, plain[:, [4, 6]], rtol=1e-4, atol=1e-4)

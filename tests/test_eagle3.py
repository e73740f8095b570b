"""The EAGLE-3 drafter (engine/spec_decode/drafters/eagle3.py) and its training (train-draft --kind eagle3):
training-time test is the drafter's rounds, and its steps 2+ read the head's own outputs, not the target's;
the engine's greedy output with a trained head, and with the same head in each published layout, is the
target's at batch > 1; sampled drafts keep the target's 3-token joint (temperature, top-p); a trained head
accepts more than an untrained one; fixed-text training generates nothing."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eagle3_formats import llama_layer_config, write_layout
from test_heads import _token_acceptance, spec
from test_sampling_controls import ALPHA, _exact_joint3, pooled_pvalue
from util import PROMPTS, TEXT, assert_greedy_grid, assert_head_kernel_matches, joint3_counts

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, Limits
from engine.core.errors import InvalidConfigError
from engine.core.forward import Features, ForwardCall
from engine.kernels.cpu_gemm import small_gemm_status
from engine.spec_decode.heads.checkpoint import load_head, save_head
from engine.spec_decode.heads.config import HeadConfig, target_fingerprint
from engine.spec_decode.heads.eagle3 import Eagle3Head
from engine.spec_decode.heads.modules import init_head
from engine.train.distill import RunOptions, TrainOptions, train_draft


@pytest.fixture(scope="module")
def e3_head(ckpt_dir, tmp_path_factory):
    """An EAGLE-3 head trained briefly by the tool on the test target's own text (draft vocabulary 200)."""
    out = tmp_path_factory.mktemp("e3") / "eagle3"
    opts = TrainOptions(
        kind="eagle3", steps=80, samples=24, prompt_len=8, gen_len=40, positions=128, heads=3, draft_vocab=200
    )
    report = train_draft(ckpt_dir, out, opts, TEXT * 16, RunOptions(progress=False, heldout=2))
    return out, report


def native_head(target_dir, out, layers, draft_vocab, seed=0, scale=1.0):
    """A random EAGLE-3 head in specmix's own format (draft vocabulary: the first ``draft_vocab`` ids)."""
    eng = Engine.from_pretrained(target_dir)
    c = eng.target.config
    cfg = HeadConfig(
        kind="eagle3",
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        intermediate_size=c.intermediate_size,
        draft_vocab=draft_vocab,
        attention_heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        feature_layers=layers,
        target=target_fingerprint(eng.target, eng.tokenizer.vocab()),
    )
    head = init_head(cfg, eng.target, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    save_head(head, cfg, torch.arange(draft_vocab), out)
    return out


def _features(eng, head: Eagle3Head, tokens):
    eng.target.use_feature_layers(head.cfg.feature_layers)
    try:
        h = eng.target.run(ForwardCall(tokens, features=Features.ALL)).features
    finally:
        eng.target.use_feature_layers(())
    return head.fuse(h.float())


def test_training_time_test_is_the_cached_rounds_on_the_heads_own_outputs(ckpt_dir, tmp_path):
    eng = Engine.from_pretrained(ckpt_dir)
    path = native_head(ckpt_dir, tmp_path / "h", (2, 2, 1), 64)
    head = load_head(path, eng.target, eng.tokenizer.vocab(), "eagle3")[0]
    tokens = torch.tensor(eng.tokenizer.encode(TEXT[:160]))[None]
    n, depth = tokens.shape[1], 4
    with torch.no_grad():
        f = _features(eng, head, tokens)[:, :-1]  # [1, n - 1, H] the fused target features
        emb = eng.target.embed_tokens(tokens[:, 1:])
        g = head.unrolled(f, emb, depth)
        for root in (0, 6, n - 2 - depth):  # the drafter's round: catch up to the root, then its own outputs
            cache = head.new_cache(1, n + 8, torch.device("cpu"))
            out = head(f[:, : root + 1], emb[:, : root + 1], torch.arange(root + 1)[None], cache, root + 1)[:, -1]
            torch.testing.assert_close(out, g[:, 0, root], rtol=1e-5, atol=1e-5)
            for j in range(1, depth):
                p = root + j
                out = head(out[:, None], emb[:, p : p + 1], torch.tensor([[p]]), cache, p + 1)[:, 0]
                torch.testing.assert_close(out, g[:, j, p], rtol=1e-5, atol=1e-5)
        # step j + 1 at p reads nothing of the target's past the root p - j: changing its features from p - 1 on
        # changes the teacher-forced step 1 at p, and none of the steps 3+ at p (rooted at p - 2 and before)
        p = 9
        f2 = f.clone()
        f2[:, p - 1 :] += 3.0
        g2 = head.unrolled(f2, emb, depth)
    assert not torch.allclose(g2[:, 0, p], g[:, 0, p])
    for j in range(2, depth):
        torch.testing.assert_close(g2[:, j, p], g[:, j, p])


def test_the_loss_of_steps_two_on_reads_the_heads_outputs(ckpt_dir, tmp_path):
    """The loss trains the head (its gradient reaches fc); step 3's scores at p depend on the target's features up
    to the root p - 2 only: the gradient they give the target's features at p - 1 and p is exactly zero."""
    from engine.train.data import DistillData
    from engine.train.losses import eagle3_loss

    eng = Engine.from_pretrained(ckpt_dir)
    head = load_head(native_head(ckpt_dir, tmp_path / "h", (2, 2, 1), 64), eng.target, eng.tokenizer.vocab(), "eagle3")[
        0
    ].requires_grad_(True)
    tokens = torch.tensor(eng.tokenizer.encode(TEXT[:100]))[None]
    T = tokens.shape[1]
    eng.target.use_feature_layers((2, 2, 1))
    with torch.no_grad():
        feats = eng.target.run(ForwardCall(tokens, features=Features.ALL)).features
    eng.target.use_feature_layers(())
    top = eng.target(tokens).float().log_softmax(-1).topk(4, -1)
    data = DistillData(tokens, torch.tensor([T]), top.values.half(), top.indices.int(), feats, 4)

    class Opts:
        heads, positions, hard_weight, reg_weight = 3, T, 0.1, 0.0

    pos_of = torch.full((eng.target.config.vocab_size,), -1).index_copy_(0, torch.arange(64), torch.arange(64))
    loss = eagle3_loss(head, eng.target, pos_of, data, Opts(), torch.Generator().manual_seed(0))
    assert loss.isfinite() and torch.autograd.grad(loss, head.fc.weight)[0].abs().sum() > 0
    f = head.fuse(feats[:, :-1].float()).detach().requires_grad_(True)  # the target's (fused) features
    out = head.unrolled(f, eng.target.embed_tokens(tokens[:, 1:]), 3)
    p = 20
    step1 = torch.autograd.grad(head.logits(out[:, 0, p]).logsumexp(-1).sum(), f, retain_graph=True)[0][0]
    step3 = torch.autograd.grad(head.logits(out[:, 2, p]).logsumexp(-1).sum(), f)[0][0]
    assert step1[p].abs().sum() > 0  # step 1 reads the target's feature at p (teacher forced)
    assert step3[p - 2].abs().sum() > 0  # step 3 at p is rooted at p - 2 ...
    assert step3[p - 1 :].abs().sum() == 0  # ... and reads the head's own outputs after it, never the target's


def test_greedy_equals_plain_with_a_trained_head(ckpt_dir, e3_head, plain):
    path, report = e3_head
    assert report["heldout"]["first_draft_acceptance"] > 0
    for k in (1, 4):
        eng = Engine.from_pretrained(ckpt_dir, path, speculation=spec("eagle3", k))
        assert_greedy_grid(eng, plain, k)
        s = eng.stats()
        assert s["drafted"] > 0 and 0 < s["acceptance_rate"] < 1


@pytest.mark.parametrize("attention_head", [False, True], ids=["eagle3", "eagle-attention"])
def test_greedy_dynamic_trees_keep_plain_tokens(ckpt_dir, e3_head, plain, tmp_path, attention_head):
    """Heads with a cache of their own draft EAGLE-2's dynamic trees (3 branches, 7 nodes), their entries in slots
    of their own under the tree's mask: the output is plain decoding's and branching trees were verified."""
    from test_heads import random_head

    from engine.api.options import SpeculationConfig

    head = random_head(ckpt_dir, tmp_path / "h", "eagle", attention=True) if attention_head else e3_head[0]
    kind = "eagle" if attention_head else "eagle3"
    sc = SpeculationConfig(drafter=kind, tree_branches=3, k=7, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, head, speculation=sc)
    assert_greedy_grid(eng, plain, kind)
    s = eng.stats()
    assert s["tree_rounds"] > 0 and s["accepted"] > 0


@pytest.mark.parametrize("cpu_pack", [True, False], ids=["cpu-kernel", "pytorch"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_heads_tree_scores_each_node_as_its_own_chain(ckpt_dir, tmp_path, monkeypatch, kind, cpu_pack):
    """EAGLE-2's tree of a head with a cache of its own (its entries in slots of their own under the tree's mask):
    every expansion's scores equal the head's step after the node's path run alone as a chain, by position, from
    the same committed cache and root feature. Batch 2, a reduced draft vocabulary, trees 3 and more deep."""
    import copy

    from test_heads import random_head

    from engine.api.options import SpeculationConfig
    from engine.spec_decode.drafters import eagle_attn

    if kind == "eagle3":
        head, norm = native_head(ckpt_dir, tmp_path / "h", (2, 2, 1), 40, scale=0.3), "norm.weight"
    else:
        head, norm = random_head(ckpt_dir, tmp_path / "h", "eagle", 40, attention=True), "out_norm.weight"
    sd = load_file(str(head / "model.safetensors"))
    sd[norm] *= 4  # surer drafts: deeper trees
    save_file(sd, str(head / "model.safetensors"))
    w = 2
    sc = SpeculationConfig(drafter=kind, tree_branches=w, k=8, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, head, speculation=sc, kernels=KernelOptions(cpu_pack=cpu_pack))
    d, rounds = eng.drafter, []
    assert (d._kernel is not None) == (cpu_pack and small_gemm_status() is None)
    root, tree = d._root, eagle_attn.masked_tree

    def spy_root(batch, k):
        out = root(batch, k)
        rounds.append({"root": out, "cache": copy.deepcopy(d.cache), "rows": batch.rows, "calls": []})
        return out

    def spy_tree(expand, logits, base, budget, branches):
        def record(pick, tokens, pos, kv_len, mask):
            out = expand(pick, tokens, pos, kv_len, mask)
            rounds[-1]["calls"].append((pick, tokens, out))
            return out

        return tree(record, logits, base, budget, branches)

    monkeypatch.setattr(d, "_root", spy_root)
    monkeypatch.setattr(eagle_attn, "masked_tree", spy_tree)
    eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12))
    assert len(rounds) > 3 and max(len(r["calls"]) for r in rounds) == 4  # budget 8 // 2 expansions
    checked = 0
    for rd in rounds[:6]:
        _, g, hlens, have, _ = rd["root"]
        calls = rd["calls"]
        for b in [b for b in range(len(hlens)) if have[b]]:
            row = torch.tensor([b if rd["rows"] is None else int(rd["rows"][b])])
            for layer, (pick, tokens, got) in enumerate(calls):
                for i in range(pick.shape[1]):
                    path, li, j = [], layer, i  # the expanded node's tokens back to the root
                    while li >= 0:
                        path.append(int(tokens[b, j] if li == layer else calls[li][1][b, j]))
                        j, li = int(calls[li][0][b, j]) // w, li - 1  # its parent: an expanded node of the layer above
                    out, zero = g[b], torch.zeros(1, dtype=torch.long)
                    d.cache = rd["cache"]  # the step on the round's committed cache, by position
                    for n, t in enumerate(reversed(path)):  # the path's entries, one by one, as a chain
                        e = d.embed(d._target_ids(torch.tensor([[t]])))
                        pos = torch.tensor([[hlens[b] + n]])
                        want, out = d._step(out.view(1, 1, -1), e, pos, hlens[b] + n + 1, row, zero)
                    torch.testing.assert_close(got[b, i], want[0], atol=1e-4, rtol=1e-4)
                    checked += 1
    assert checked > 40


def test_a_row_that_reads_its_drafts_in_order_gets_a_chain(ckpt_dir, tmp_path, monkeypatch):
    """A greedy batch with a repetition penalty in one row: the head drafts chains of K for the batch (the row reads
    its drafts in order; a tree's first branch would be shorter), trees without it; outputs are plain decoding's."""
    from test_heads import random_head

    from engine.api.options import SpeculationConfig

    head = random_head(ckpt_dir, tmp_path / "h", "eagle", attention=True)
    sc = SpeculationConfig(drafter="eagle", tree_branches=2, k=6, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, head, speculation=sc)
    d, shapes = eng.drafter, []
    chain, tree = d._chain, d._tree
    monkeypatch.setattr(d, "_chain", lambda b: shapes.append("chain") or chain(b))
    monkeypatch.setattr(d, "_tree", lambda b, w: shapes.append("tree") or tree(b, w))
    params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, repetition_penalty=1.3)]
    want = [o.token_ids for o in Engine.from_pretrained(ckpt_dir).generate(PROMPTS[:2], params)]
    assert [o.token_ids for o in eng.generate(PROMPTS[:2], params)] == want
    assert shapes[0] == "chain"
    shapes.clear()
    eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10))
    assert shapes and set(shapes) == {"tree"}


@pytest.mark.parametrize("layout", ["authors", "authors-bin", "speculators"])
def test_the_same_head_in_a_published_layout_drafts_the_same(ckpt_dir, e3_head, plain, tmp_path, layout):
    """The trained head's weights written in a published layout: the same outputs (the target's), the same
    drafts accepted, batch 1 and 4."""
    path, _ = e3_head
    sd = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "head_config.json").read_text())
    H, V, n = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab"]
    layer = llama_layer_config(H, V, n, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layer.update(intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=10000.0)
    kw = {"aux": list(cfg["feature_layers"])} if layout == "speculators" else {}
    if layout == "speculators":
        kw["transformer_layer_config"] = layer
    published = write_layout(tmp_path / layout, layout, sd, H, V, n, **kw, **({} if kw else layer))
    stats = []
    for head in (path, published):
        eng = Engine.from_pretrained(ckpt_dir, head, speculation=spec("eagle3", 3))
        assert_greedy_grid(eng, plain, layout)
        stats.append((eng.stats()["drafted"], eng.stats()["accepted"]))
    assert stats[0] == stats[1] and stats[0][1] > 0


def test_trained_head_accepts_better_than_untrained(ckpt_dir, e3_head, tmp_path):
    path, _ = e3_head
    untrained = tmp_path / "untrained"
    eng = Engine.from_pretrained(ckpt_dir)
    cfg = json.loads((path / "head_config.json").read_text())
    hc = HeadConfig(**{**cfg, "feature_layers": tuple(cfg["feature_layers"])})
    save_head(init_head(hc, eng.target, 1), hc, torch.arange(cfg["draft_vocab"]), untrained)
    trained_rate = _token_acceptance(ckpt_dir, path, "eagle3", PROMPTS)
    assert trained_rate > _token_acceptance(ckpt_dir, untrained, "eagle3", PROMPTS) + 0.1


def test_sampled_drafts_keep_the_targets_three_token_joint(pair8, tmp_path):
    """Temperature and top-p, K = 2: tokens 2 and 3 are the head's drafts (token 1 comes from the prefill); the
    draft vocabulary holds 6 of the 8 tokens, so the residual covers the other two."""
    target, _ = pair8
    head = native_head(target, tmp_path / "h", (0, 1, 1), 6, seed=2, scale=2.0)
    eng = Engine.from_pretrained(target, head, speculation=spec("eagle3", 2), limits=Limits(max_batch=1000))
    prompt, sp = [1, 2, 3], SamplingParams(max_new_tokens=3, temperature=1.0, top_p=0.9)
    exact, counts = _exact_joint3(eng, prompt, sp), joint3_counts(eng, prompt, sp, 3)
    assert counts[exact == 0].sum() == 0
    assert 0.05 < eng.stats()["acceptance_rate"] < 0.95
    assert pooled_pvalue(counts, exact) > ALPHA


def test_sampled_spine_trees_keep_the_targets_three_token_joint(pair8, tmp_path):
    """Temperature and top-k with trees (3 i.i.d. draws per depth around the head's sampled chain, 6 nodes): the
    target's exact 3-token joint, nothing of probability zero, and branching trees verified."""
    from engine.api.options import SpeculationConfig

    target, _ = pair8
    head = native_head(target, tmp_path / "h", (0, 1, 1), 6, seed=2, scale=2.0)
    sc = SpeculationConfig(drafter="eagle3", tree_branches=3, k=6, k_policy="constant")
    eng = Engine.from_pretrained(target, head, speculation=sc, limits=Limits(max_batch=1000))
    prompt, sp = [1, 2, 3], SamplingParams(max_new_tokens=8, temperature=1.2, top_k=6)
    exact, counts = _exact_joint3(eng, prompt, sp), joint3_counts(eng, prompt, sp, 3)
    assert counts[exact == 0].sum() == 0
    assert eng.stats()["tree_rounds"] > 0
    assert pooled_pvalue(counts, exact) > ALPHA


def test_fixed_text_training_generates_nothing(ckpt_dir, tmp_path):
    opts = TrainOptions(kind="eagle3", steps=5, samples=6, prompt_len=8, gen_len=24, heads=2, data="text")
    report = train_draft(ckpt_dir, tmp_path / "h", opts, TEXT * 4, RunOptions(progress=False, heldout=0))
    assert report["gen_s"] == 0.0 and report["generated_tokens"] == 6 * 24
    eng = Engine.from_pretrained(ckpt_dir, tmp_path / "h", speculation=spec("eagle3", 2))
    assert eng.drafter.head.cfg.feature_layers == (2, 2, 1)
    with pytest.raises(InvalidConfigError, match="feature_layers"):
        TrainOptions(kind="eagle", feature_layers=(1, 2, 3))
    with pytest.raises(InvalidConfigError, match="cuda_graphs=False for this head"):
        Engine.from_pretrained(
            ckpt_dir,
            tmp_path / "h",
            speculation=spec("eagle3", 2),
            kernels=KernelOptions(cuda_graphs=True, emulate_graphs=True),
        )


def test_fp8_plan_covers_the_heads_projections_and_stays_lossless(ckpt_dir, e3_head, planned_plain):
    """The draft plan's FP8 on the EAGLE-3 head: fc and the layer's projections FP8Linear (weight-only on this
    CPU), its own LM head and norms kept; the planned bytes are what it stores; greedy output still the target's."""
    import copy

    from test_head_fp8 import head_plan

    from engine.api.options import PrecisionConfig
    from quant.head_plan import apply_head_plan
    from quant.linear import FP8Linear

    path, _ = e3_head
    plan = head_plan(ckpt_dir, path)
    ffn = plan.draft.families["ffn"]
    names = ["fc"] + [f"midlayer.self_attn.{x}_proj" for x in "qkvo"]
    names += [f"midlayer.mlp.{x}_proj" for x in ("gate", "up", "down")]
    assert plan.draft.head == "eagle3" and ffn.storage == "fp8_e4m3" and ffn.scaling["modules"] == names
    eng = Engine.from_pretrained(ckpt_dir)
    ref = load_head(path, eng.target, eng.tokenizer.vocab(), "eagle3")[0]
    head = copy.deepcopy(ref)
    assert apply_head_plan(head, plan.draft) == names and type(head.lm_head) is torch.nn.Linear
    x = torch.randn(5, 3 * ref.mcfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert float((head.fuse(x).float() - ref.fuse(x)).norm() / ref.fuse(x).norm()) <= 0.06
    stored = sum(m.weight_bytes() for m in head.modules() if isinstance(m, FP8Linear))
    stored += sum(p.numel() * 2 for n, p in head.named_parameters() if "norm" in n or n == "lm_head.weight")
    assert plan.memory.draft_weight_bytes == stored + 8 * ref.cfg.draft_vocab
    spec_eng = Engine.from_pretrained(ckpt_dir, path, speculation=spec("eagle3", 3), precision=PrecisionConfig(plan))
    assert spec_eng.info["draft_head_fp8"] == names
    assert_greedy_grid(spec_eng, planned_plain, "fp8")  # the planned target's own greedy output
    assert spec_eng.stats()["accepted"] > 0


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_cpu_kernel_equals_the_pytorch_layer(ckpt_dir, tmp_path, norm_before_residual):
    """``Eagle3HeadKernel`` (the decode step's forward_pair) with fp32 weights: the same scores and layer outputs
    as the head's PyTorch forward, for a ragged batch in cache rows 2 and 0, then one more entry each."""
    from engine.core.model import rope_cos_sin
    from engine.kernels.cpu_gemm import small_gemm_status
    from engine.kernels.cpu_head import Eagle3HeadKernel, head_gemm_weight

    if small_gemm_status() is not None:
        pytest.skip(f"no CPU kernels: {small_gemm_status()}")
    eng = Engine.from_pretrained(ckpt_dir)
    path = native_head(ckpt_dir, tmp_path / "h", (2, 2, 1), 64, seed=3)
    cfg = json.loads((path / "head_config.json").read_text())
    (path / "head_config.json").write_text(json.dumps({**cfg, "norm_before_residual": norm_before_residual}))
    head = load_head(path, eng.target, eng.tokenizer.vocab(), "eagle3")[0].float()
    kernel = Eagle3HeadKernel(head, head.kernel_weights(head_gemm_weight), torch.float32)
    assert_head_kernel_matches(head, kernel, head.logits)
    H, e = head.mcfg.hidden_size, torch.empty(0, dtype=torch.long)
    cache = head.new_cache(1, 32, torch.device("cpu"))
    cos, sin = (t[0, 0].contiguous() for t in rope_cos_sin(head.inv_freq, torch.arange(32)[None], torch.float32))
    with pytest.raises(RuntimeError, match="a wide first layer takes forward_pair"):  # its q/k/v read 2H inputs
        kernel.impl.forward_x(
            torch.zeros(1, 1, H),
            torch.zeros(1, 1, dtype=torch.long),
            e,
            e,
            1,
            1,
            cache.k,
            cache.v,
            cos,
            sin,
            torch.empty(1),
            e,
            e,
        )


def test_the_default_draft_vocabulary_is_the_tokens_the_text_holds():
    """eagle3's default: every distinct token of the training text (padding past a row's length not counted),
    at most the cap; the other heads keep the full vocabulary by default."""
    from engine.train.data import DistillData
    from engine.train.distill import default_draft_vocab

    tokens = torch.tensor([[5, 7, 5, 9, 0, 0], [7, 7, 11, 3, 2, 0]])
    data = DistillData(tokens, torch.tensor([4, 5]), torch.empty(0), torch.empty(0), None, 1)
    assert default_draft_vocab("eagle3", data) == 6  # 5, 7, 9, 11, 3, 2: the padding's 0 is not text
    assert default_draft_vocab("eagle", data) is None
    assert default_draft_vocab("eagle3", data, cap=4) == 4

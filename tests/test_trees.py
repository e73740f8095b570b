"""Draft trees: the mask, one verify pass against each branch run alone, greedy identity, the exact sampled joint."""

from __future__ import annotations

import pytest
import torch
from test_sampling_controls import ALPHA, _exact_joint3, pooled_pvalue
from util import PROMPTS, assert_greedy_grid, joint3_counts

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.forward import ForwardCall, KVCache
from engine.spec_decode.drafter import FeatureNeed
from engine.spec_decode.proposal import Proposal
from engine.spec_decode.registry import DRAFTERS, DrafterEntry
from engine.spec_decode.tree import ancestors, tree_mask
from engine.spec_decode.verify import verify, verify_batch

# node: token offset from the last token, parent. Depths 1, 1, 1, 2, 2, 2, 3: branching 3 then 2.
TREE = [(1, -1), (3, -1), (6, -1), (2, 0), (5, 0), (4, 1), (1, 3)]


def test_mask_sees_context_ancestors_and_self_only():
    parents = torch.tensor([[p for _, p in TREE]])
    anc = ancestors(parents)[0]
    assert anc[6].tolist() == [True, False, False, True, False, False, True]  # 6 -> 3 -> 0
    pos = torch.tensor([[10, 11, 63, 63, 63, 63, 63, 63, 63]])  # 2 catch-up tokens, then 7 node columns
    pos[0, 2:] = 0
    tm = tree_mask(pos, [2], [10], parents, [7], 19)
    m = tm.mask[0, 0]
    assert tm.slots[0].tolist() == list(range(10, 19)) and pos[0].tolist() == [10, 11, 12, 12, 12, 13, 13, 13, 14]
    assert m[0, :11].tolist() == [True] * 11 and not m[0, 11:].any()  # catch-up: causal by slot
    for n in range(7):
        seen = m[2 + n, 12:].tolist()
        assert seen == anc[n].tolist() and m[2 + n, :12].all()  # the context, its ancestors, itself only


@pytest.mark.parametrize("kernel", [False, True], ids=["pytorch", "cpu-step"])
def test_one_verify_pass_scores_every_branch_as_its_own_chain(ckpt_dir, kernel):
    """The tree's logits at each node equal the target's logits over context + the node's path (no cache), on
    PyTorch's layers and on the CPU's one-call step (its slots and mask)."""
    from engine.api.options import KernelOptions
    from engine.kernels.cpu_gemm import small_gemm_status

    if kernel and small_gemm_status() is not None:
        pytest.skip(f"no CPU kernels: {small_gemm_status()}")
    model = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=kernel)).target
    assert (model.layer_step is not None) == kernel
    ctx = PROMPTS[3]
    cache = KVCache(model.config, 2, 64, torch.float32, "cpu")
    with torch.no_grad():
        model.run(ForwardCall(torch.tensor([ctx[:-1]]), None, cache, len(ctx) - 1, torch.tensor([1])))
    toks = torch.tensor([[(ctx[-1] + d) % 290 + 1 for d, _ in TREE]])
    prop = Proposal(toks, None, [7], torch.tensor([[p for _, p in TREE]]))
    vb = verify_batch([ctx], [len(ctx) - 1], prop, [1], 63, FeatureNeed.NONE)
    with torch.no_grad():
        got = verify(model, cache, vb).logits[0]  # [8, V]: the root, then each node
        if kernel:
            assert model.layer_step.takes(ForwardCall(vb.tokens, vb.pos, cache, 19, None, tree=vb.tree))
        for n in range(7):
            path, m = [], n
            while m >= 0:
                path.insert(0, int(toks[0, m]))
                m = TREE[m][1]
            want = model(torch.tensor([ctx + path]))[0, -1]
            torch.testing.assert_close(got[n + 1], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[0], model(torch.tensor([ctx]))[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpu_pack", [None, False])
def test_ngram_trees_are_token_identical_to_plain(ckpt_dir, plain, cpu_pack):
    """Trees of up to 3 continuations (ragged accepted paths, their nodes moved into place in the cache)."""
    from engine.api.options import KernelOptions

    spec = SpeculationConfig(drafter="ngram", tree_branches=3, k=6, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, speculation=spec, kernels=KernelOptions(cpu_pack=cpu_pack))
    assert_greedy_grid(eng, plain, "ngram tree", cpu_pack)
    assert eng.stats()["accepted"] > 0


@pytest.mark.parametrize("cpu_pack", [True, False])
def test_draft_model_trees_are_token_identical_to_plain(ckpt_dir, draft_dir, plain, cpu_pack):
    """The draft model's dynamic trees (its own cache written at the expanded nodes' slots under a tree mask)."""
    from engine.api.options import KernelOptions

    spec = SpeculationConfig(drafter="model", tree_branches=2, k=6, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=spec, kernels=KernelOptions(cpu_pack=cpu_pack))
    assert_greedy_grid(eng, plain, "model tree", cpu_pack)
    st = eng.stats()
    assert st["accepted"] > 0 and st["mean_accepted_length"] > 2


@pytest.mark.parametrize("cpu_pack", [True, False], ids=["cpu-step", "pytorch"])
def test_a_tree_expansion_scores_each_node_as_its_path_alone(ckpt_dir, cpu_pack):
    """EAGLE-2's tree in a model's own cache, ragged rows (3 and 6 committed tokens) and its deepest expansions
    (the last expansion index): every expanded node's logits equal the model's over the row's tokens and the node's
    path, run without a cache."""
    from engine.api.options import KernelOptions
    from engine.spec_decode.drafters.draft_tree import masked_tree

    model = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=cpu_pack)).target
    ctx = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]
    cache = KVCache(model.config, 2, 64, model.dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    for t in (cache.k, cache.v):  # noise in every slot not written: a mask that lets one through shows
        t.copy_(torch.randn(t.shape, generator=g) * 3)
    root = []
    for b, toks in enumerate(ctx):
        call = ForwardCall(torch.tensor([toks]), torch.arange(len(toks))[None], cache, len(toks), torch.tensor([b]))
        root.append(model.run(call).logits[0, -1])
    calls = []

    def expand(pick, tokens, pos, kv_len, tree):
        logits = model.run(ForwardCall(tokens, pos, cache, kv_len, None, tree=tree)).logits
        calls.append((pick, tokens, logits))
        return logits

    w = 2
    masked_tree(expand, torch.stack(root), torch.tensor([3, 6]), 8, w)
    assert len(calls) == 4
    for b, toks in enumerate(ctx):
        for layer, (pick, _, got) in enumerate(calls):
            for i in range(pick.shape[1]):
                path, li, j = [], layer, i  # the expanded node's tokens back to the root
                while li >= 0:
                    path.append(int(calls[li][1][b, j]))
                    j, li = int(calls[li][0][b, j]) // w, li - 1
                alone = model.run(ForwardCall(torch.tensor([toks + path[::-1]]))).logits[0, -1]
                torch.testing.assert_close(got[b, i], alone, atol=1e-4, rtol=1e-4)


def test_the_measured_policy_chooses_trees_or_chains_per_batch_and_keeps_the_tokens(ckpt_dir, draft_dir, plain):
    """The default K policy with a tree-capable drafter: the tuner runs tree and chain arms (each round's shape is
    its choice) and greedy outputs stay plain decoding's."""
    spec = SpeculationConfig(drafter="model", tree_branches=2, k=4)
    eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=spec)
    assert eng.policy.name == "measured" and eng.policy.trees
    assert_greedy_grid(eng, plain, "measured trees")
    st = eng.stats()
    assert 0 < st["tree_rounds"] < st["sequence_rounds"] and st["accepted"] > 0


def test_a_seeded_sampled_row_keeps_its_drafts_shape_in_any_batch(ckpt_dir):
    """Under the measured policy a seeded sampled row drafts trees as configured whatever the tuner chose for the
    batch: its tokens are the same alone and beside greedy rows."""
    spec = SpeculationConfig(drafter="ngram", tree_branches=3, k=4)
    prompt = [10, 11, 12, 10, 11, 13, 10, 11, 14, 10, 11]
    seeded = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)
    alone = Engine.from_pretrained(ckpt_dir, speculation=spec).generate([prompt], seeded)[0].token_ids
    eng = Engine.from_pretrained(ckpt_dir, speculation=spec)
    greedy = SamplingParams(max_new_tokens=24)
    for _ in range(3):  # the tuner's arms change between these batches
        outs = eng.generate([prompt, [5, 6, 5, 7, 5, 6, 5], prompt, [3, 4, 3, 4, 3]], [greedy, greedy, seeded, greedy])
        assert outs[2].token_ids == alone


def test_medusa_trees_are_token_identical_to_plain(ckpt_dir, plain, tmp_path, monkeypatch):
    """Greedy Medusa trees (each depth's children: that head's top tokens) keep plain decoding's tokens."""
    from test_heads import random_head

    from engine.spec_decode.drafters.medusa import MedusaDrafter

    shapes: list[bool] = []
    propose = MedusaDrafter.propose

    def spy(self, batch):
        prop = propose(self, batch)
        shapes.append(prop.parents is not None and bool((prop.depth() < torch.arange(1, prop.width + 1)).any()))
        return prop

    monkeypatch.setattr(MedusaDrafter, "propose", spy)
    head = random_head(ckpt_dir, tmp_path / "medusa", "medusa")
    spec = SpeculationConfig(drafter="medusa", tree_branches=3, k=6, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, head, speculation=spec)
    assert_greedy_grid(eng, plain, "medusa tree")
    assert eng.stats()["accepted"] > 0 and any(shapes)  # some rounds drafted branching trees


class FixedTree:
    """A test drafter: TREE's shape under the last token. ``iid``: every child drawn i.i.d. from a fixed
    distribution p (the batch's Exp(1) noise), else the fixed distinct tokens (p one-hot)."""

    features = FeatureNeed.NONE
    max_drafts = None

    def __init__(self, vocab: int, iid: bool) -> None:
        self.iid = self.samples = iid  # (i.i.d. children are drawn with the round's draft noise)
        self.p = torch.softmax(torch.linspace(1.5, -1.5, vocab), 0)  # not the target's

    def propose(self, batch):
        B, k, V = len(batch.seqs), batch.k, batch.vocab
        parents = torch.tensor([[p for _, p in TREE][:k]] * B)
        if self.iid:
            assert batch.noise is not None
            toks = (self.p / batch.noise[:, :k]).argmax(-1)  # [B, k]: an Exp race, one draw of p per node
            return Proposal(toks, self.p.expand(B, k, V).contiguous(), None, parents)
        last = torch.tensor([s.tokens[-1] for s in batch.seqs])
        toks = (last[:, None] + torch.tensor([d for d, _ in TREE][:k])) % V
        return Proposal(toks, None, None, parents)

    def commit(self, seq, outcome):
        pass

    def ensure_cache(self, max_batch, max_seq_len):
        pass

    def share_prefill(self, src, dst, length):
        pass

    def catch_up(self, seqs, scratch_pos: int) -> int:
        return 0

    def cost_step(self, batch):
        return None


CASES = {
    "t1.0": {"temperature": 1.0},
    "t1.5-k5-p0.9": {"temperature": 1.5, "top_k": 5, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.3},
    "penalties": {"temperature": 1.0, "repetition_penalty": 1.8, "presence_penalty": 1.0},  # its first branch
}


@pytest.mark.parametrize(
    "case,iid", [("t1.0", False), ("t1.0", True), ("t1.5-k5-p0.9", False), ("min_p", True), ("penalties", False)]
)
def test_tree_sampling_keeps_the_target_joint(pair8, case, iid):
    """The 3-token joint under trees of branching 3 then 2 (7 nodes) equals the target's exact one (chi-square),
    no sequence of zero probability appears, and ignoring the sampling controls would be detected."""
    reg = DRAFTERS.extended(DrafterEntry("fixed-tree", "a test tree", lambda ctx: FixedTree(8, iid)))
    spec = SpeculationConfig(drafter="fixed-tree", k=7, k_policy="constant", registry=reg)
    eng = Engine.from_pretrained(pair8[0], speculation=spec, limits=Limits(max_batch=1000))
    prompt = [1, 2, 3]
    sp = SamplingParams(max_new_tokens=9, **CASES[case])  # the second round (the first drafts none): the whole tree
    exact, counts = _exact_joint3(eng, prompt, sp), joint3_counts(eng, prompt, sp, 6)
    assert counts[exact == 0].sum() == 0, "a sequence of zero probability was produced"
    acc = eng.scheduler.snapshot()["totals"].pos_accepted
    assert len(acc) >= 3 and acc[2] > 0  # paths of depth 3 were accepted

    assert pooled_pvalue(counts, exact) > ALPHA
    if case != "t1.0":
        plain_t = SamplingParams(max_new_tokens=3, temperature=CASES[case]["temperature"])
        assert pooled_pvalue(counts, _exact_joint3(eng, prompt, plain_t)) < ALPHA


@pytest.mark.parametrize(
    "drafter,case", [("model", "t1.5-k5-p0.9"), ("eagle", "t1.0"), ("eagle", "penalties"), ("medusa", "min_p")]
)
def test_sampled_spine_trees_keep_the_target_joint(pair8, tmp_path, drafter, case):
    """Sampled rows' trees of i.i.d. siblings around the drafter's sampled chain (3 per depth, 6 nodes): the
    3-token joint is the target's exact one; rows with penalties take the spine (the first branch)."""
    from test_heads import random_head

    target, draft = pair8
    if drafter != "model":
        draft = random_head(target, tmp_path / "head", drafter, scale=2.0, seed=4)
    spec = SpeculationConfig(drafter=drafter, tree_branches=3, k=6, k_policy="constant")
    eng = Engine.from_pretrained(target, draft, speculation=spec, limits=Limits(max_batch=1000))
    prompt = [1, 2, 3]
    sp = SamplingParams(max_new_tokens=8, **CASES[case])  # a round's tree reaches depth 2 within the 3 tokens
    exact, counts = _exact_joint3(eng, prompt, sp), joint3_counts(eng, prompt, sp, 5)
    assert counts[exact == 0].sum() == 0, "a sequence of zero probability was produced"
    st = eng.stats()
    assert 0.05 < st["acceptance_rate"] < 0.95
    assert (st["tree_rounds"] > 0) == (case != "penalties")  # penalties: every row takes its spine, a chain
    assert pooled_pvalue(counts, exact) > ALPHA


def test_a_spine_tree_is_the_chain_with_independent_siblings():
    from engine.spec_decode.drafter import DraftBatch
    from engine.spec_decode.drafters.spine_tree import spine_batch, spine_tree

    g = torch.Generator().manual_seed(0)
    B, K, V, w = 2, 7, 5, 3
    noise = torch.empty(B, K, V).exponential_(generator=g)

    def batch(chains):
        return DraftBatch([None] * B, None, None, K, [K] * B, noise, V, 0, None, torch.device("cpu"), chains=chains)

    spine_b = spine_batch(batch(None), w)
    assert spine_b.k == 3 and torch.equal(spine_b.noise, noise[:, [0, 3, 6]])  # the spine nodes' noise vectors
    p = torch.softmax(torch.randn(B, K, V, generator=g), -1)  # a distribution per chain step
    spine = (p[:, :3] / spine_b.noise).argmax(-1)  # the chain drawn for the spine batch
    tree = spine_tree(Proposal.chain(spine, p[:, :3]), batch(None), w)
    assert tree.parents.tolist() == [[-1, -1, -1, 0, 0, 0, 3]] * B  # depth 1: 3 nodes, depth 2: 3, depth 3: 1
    assert torch.equal(tree.tokens[:, [0, 3, 6]], spine)  # the spine is each depth's first node
    assert torch.equal(tree.tokens, (tree.probs / noise).argmax(-1))  # every node: its own draw from its depth's p
    assert torch.equal(tree.probs[:, 4], p[:, 1])
    first = tree.first_branches([0, 1])
    assert first.row_counts() == [3, 3] and torch.equal(first.tokens[:, :3], spine)
    # row 1 reads its drafts in order: a chain of K drafts with the vectors 0..K-1; row 0 keeps its tree
    mixed_b = spine_batch(batch([False, True]), w)
    assert (
        mixed_b.k == K
        and torch.equal(mixed_b.noise[1], noise[1])
        and torch.equal(mixed_b.noise[0, :3], noise[0, [0, 3, 6]])
    )
    drawn = (p / mixed_b.noise).argmax(-1)
    mixed = spine_tree(Proposal.chain(drawn, p), batch([False, True]), w)
    assert mixed.parents[1].tolist() == list(range(-1, K - 1)) and torch.equal(mixed.tokens[1], drawn[1])
    assert torch.equal(mixed.tokens[0], tree.tokens[0]) and torch.equal(mixed.parents[0], tree.parents[0])


def test_ngram_tree_merges_the_continuations_of_several_matches():
    from types import SimpleNamespace

    from engine.spec_decode.drafters.ngram import NGramDrafter

    ctx = [1, 2, 3, 7, 1, 2, 4, 7, 1, 2, 3, 8, 1, 2]  # "1 2" was followed by 3 7, 4 7, 3 8 (latest first: 3 8)
    seqs = [SimpleNamespace(tokens=ctx), SimpleNamespace(tokens=[5, 6])]
    batch = SimpleNamespace(seqs=seqs, k=6, ks=[6, 6], device=torch.device("cpu"))
    p = NGramDrafter(branches=3)._propose_tree(batch)
    n = p.row_counts()[0]
    nodes = [(int(p.tokens[0, i]), int(p.parents[0, i])) for i in range(n)]
    assert nodes == [(3, -1), (4, -1), (8, 0), (7, 1), (7, 0), (1, 2)]  # depth by depth; "3" shared once
    assert p.row_counts()[1] == 0
    assert NGramDrafter(branches=1).lookup(ctx, 3) == [3, 8, 1]  # the chain: the first branch's tokens
    small = SimpleNamespace(seqs=seqs[:1], k=6, ks=[3], device=torch.device("cpu"))
    assert NGramDrafter(branches=3)._propose_tree(small).row_counts() == [3]  # the node budget


def test_ngram_trees_on_repetitive_prompts_match_plain(ckpt_dir):
    """Prompts with many earlier matches (branching trees every round), batch 3, against plain decoding."""
    prompts = [[10, 11, 12, 10, 11, 13, 10, 11, 14, 10, 11], [5, 6, 5, 7, 5, 6, 5, 8, 5], [3, 4, 3, 4, 3, 9, 3]]
    sp = SamplingParams(max_new_tokens=30)
    want = [o.token_ids for o in Engine.from_pretrained(ckpt_dir).generate(prompts, sp)]
    spec = SpeculationConfig(drafter="ngram", tree_branches=4, k=8, k_policy="constant")
    eng = Engine.from_pretrained(ckpt_dir, speculation=spec)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == want
    assert [o.token_ids for o in eng.generate(prompts[:1], sp)] == want[:1]


def test_dynamic_tree_keeps_the_most_probable_nodes_with_their_ancestors():
    """A fake head whose next-token distribution depends on the token: the kept nodes are the budget's most
    probable paths (checked by brute force over the generated layers), ancestors first, siblings distinct."""
    from engine.spec_decode.drafters.head_tree import dynamic_tree

    V = 7
    table = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 2, -1)

    def step(f, tok):
        return f + 1, table[tok].log()

    toks, parents, scores = dynamic_tree(step, torch.zeros(2, 4), torch.tensor([0, 5]), 6, 2, None)
    assert toks.shape == parents.shape == (2, 6)
    for b in range(2):
        par, tk = parents[b].tolist(), toks[b].tolist()
        for n, p in enumerate(par):
            assert p < n  # topological
            last = [0, 5][b] if p < 0 else tk[p]
            want = (0.0 if p < 0 else float(scores[b, p])) + float(table[last, tk[n]].log())
            assert abs(float(scores[b, n]) - want) < 1e-4  # the path's log-probability
        kids = {}
        for n, p in enumerate(par):
            kids.setdefault(p, []).append(tk[n])
        assert all(len(v) == len(set(v)) for v in kids.values())  # distinct siblings
        assert min(scores[b, par[n]] for n in range(6) if par[n] >= 0) >= scores[b].min()  # parents rank higher
    lp2, top2 = table[0].log().topk(2)
    roots = [t for t, p in zip(toks[0].tolist(), parents[0].tolist()) if p < 0]
    assert roots[0] == top2[0]  # the root's best child first
    if top2[1] not in roots:  # the second child was dropped: every kept path is at least as probable
        assert float(scores[0].min()) >= float(lp2[1]) - 1e-4

"""The EAGLE head with attention (engine/spec_decode/heads/eagle_attn.py): its training-time unroll is exactly
the rounds the drafter runs through its KV cache; the engine's output with it is the target's (greedy identity
over prompts x K x batch, prefill sharing, exact sampling); a trained head accepts better than an untrained one
and better than the head without attention; CUDA graphs of it are refused at load."""

from __future__ import annotations

import json

import pytest
import torch
from test_heads import _token_acceptance, random_head, spec
from util import PROMPTS, TEXT, assert_greedy_grid, assert_head_kernel_matches

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, PrecisionConfig
from engine.core.errors import InvalidConfigError
from engine.core.forward import Features, ForwardCall
from engine.core.tokenizer import Tokenizer
from engine.kernels.cpu_gemm import small_gemm_status
from engine.spec_decode.heads.checkpoint import load_head, save_head
from engine.spec_decode.heads.config import HeadConfig
from engine.spec_decode.heads.eagle_attn import EagleAttnHead
from engine.spec_decode.heads.modules import init_head
from engine.train.distill import RunOptions, TrainOptions, train_draft


@pytest.fixture(scope="module")
def attn_head(ckpt_dir, tmp_path_factory):
    """An attention head trained briefly by the tool on the test target's own text."""
    out = tmp_path_factory.mktemp("attn") / "eagle-attn"
    opts = TrainOptions(
        kind="eagle", attention=True, steps=60, samples=24, prompt_len=8, gen_len=40, positions=128, heads=3
    )
    train_draft(ckpt_dir, out, opts, TEXT * 4, RunOptions(progress=False))
    return out


def test_unrolled_rounds_equal_the_cached_rounds(ckpt_dir, tmp_path):
    """Every depth of ``unrolled`` from every root equals drafting through the cache: the committed entries up
    to the root, then one entry per draft on the head's own feature (teacher forced along the tokens)."""
    eng = Engine.from_pretrained(ckpt_dir)
    target = eng.target
    path = random_head(ckpt_dir, tmp_path / "h", "eagle", attention=True)
    head = load_head(path, target, eng.tokenizer.vocab(), "eagle")[0]
    head = head.float()
    assert isinstance(head, EagleAttnHead) and len(head.layers) == 1
    tokens = torch.tensor(eng.tokenizer.encode(TEXT[:200]))[None]  # [1, n]
    n, depth = tokens.shape[1], 4
    with torch.no_grad():
        feats = target.run(ForwardCall(tokens, features=Features.SCORED)).features.float()  # [1, n, H]
        emb = target.embed_tokens(tokens[:, 1:]).float()  # the token after each position
        g = head.unrolled(feats[:, :-1], emb, depth)  # [1, depth, n - 1, H]
        for root in (0, 5, n - 1 - depth):
            cache = head.new_cache(1, n + 8, torch.device("cpu"))
            pos = torch.arange(root + 1)[None]
            out = head(feats[:, : root + 1], emb[:, : root + 1], pos, cache, root + 1)
            f = out[:, -1]
            torch.testing.assert_close(f, g[:, 0, root], rtol=1e-5, atol=1e-5)
            for j in range(1, depth):  # the round's entry root + j reads the previous draft's feature
                p = root + j
                f = head(f[:, None], emb[:, p : p + 1], torch.tensor([[p]]), cache, p + 1)[:, 0]
                torch.testing.assert_close(f, g[:, j, p], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "pytorch"])
def test_greedy_equals_plain(ckpt_dir, attn_head, plain, k, kernel):
    """On the C++ decode step's kernel (fp16 weight copies, when this CPU has it) and on PyTorch's layers."""
    if kernel and small_gemm_status() is not None:
        pytest.skip(f"no CPU kernels: {small_gemm_status()}")
    kernels = KernelOptions() if kernel else KernelOptions(cpu_pack=False)
    eng = Engine.from_pretrained(ckpt_dir, attn_head, speculation=spec("eagle", k), kernels=kernels)
    assert eng.info["draft_head_step_weights"] == ("float16" if kernel else None)
    assert_greedy_grid(eng, plain, k)
    s = eng.stats()
    assert s["drafted"] > 0 and 0 < s["acceptance_rate"] < 1


def test_ragged_batch_and_shared_prefill(ckpt_dir, attn_head, plain):
    """Requests joining mid-flight with various lengths, and n samples of one prompt sharing its prefill (each
    copy gets the prompt's features from the one that prefilled it)."""
    eng = Engine.from_pretrained(ckpt_dir, attn_head, speculation=spec("eagle", 3))
    lens = [40, 7, 25, 40, 13, 40]
    reqs = [eng.submit(PROMPTS[i], SamplingParams(max_new_tokens=n)) for i, n in enumerate(lens)]
    assert [r.result().token_ids for r in reqs] == [plain[i][:n] for i, n in enumerate(lens)]
    before = eng.stats()["drafted"]
    outs = eng.generate([PROMPTS[2]] * 3, SamplingParams(max_new_tokens=40))
    assert [o.token_ids for o in outs] == [plain[2]] * 3
    assert eng.stats()["drafted"] > before


def test_sampled_output_matches_the_target_distribution(tmp_path):
    from test_heads import test_sampled_heads_match_the_target_distribution as check
    from util import make_checkpoint

    kw = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "eos_token_id": None}
    check((make_checkpoint(tmp_path / "t", seed=3, **kw), tmp_path), "eagle", None, attention=True)


def test_cuda_graphs_of_the_head_are_refused_at_load(ckpt_dir, attn_head):
    with pytest.raises(InvalidConfigError, match="CUDA graphs of the EAGLE head with attention are not built"):
        Engine.from_pretrained(
            ckpt_dir, attn_head, speculation=spec("eagle"), kernels=KernelOptions(cuda_graphs=True, emulate_graphs=True)
        )


@pytest.fixture(scope="module")
def tiny_eagles(tiny_demo, tmp_path_factory):
    """EAGLE heads with and without attention, trained alike in seconds on the tiny demo target's own text."""
    target, _ = tiny_demo
    d = tmp_path_factory.mktemp("tiny-eagles")
    train = (target.parent / "calib.txt").read_text(encoding="utf-8")
    for attention in (False, True):
        opts = TrainOptions(
            kind="eagle", attention=attention, steps=150, samples=48, prompt_len=16, gen_len=64, heads=3
        )
        train_draft(target, d / str(attention), opts, train, RunOptions(progress=False, heldout=0))
    return target, d


def test_trained_attention_head_accepts_better(tiny_eagles, tmp_path):
    """On the tiny demo target: trained beats untrained by far, and attention over the sequence does as well as the
    one-feature head trained on the same text with the same steps (on this target the two differ by less than the
    runs' spread: which one leads moves with the CPU's rounding of the training, by 0.01-0.02 either way)."""
    target, d = tiny_eagles
    ids = Tokenizer(target).encode((target.parent / "heldout.txt").read_text(encoding="utf-8"))
    prompts = [ids[i : i + 24] for i in range(0, 150 * 32, 150)]  # held-out prompts (never trained on)
    acc = {a: _token_acceptance(target, d / str(a), "eagle", prompts) for a in (False, True)}
    cfg = HeadConfig(**json.loads((d / "True" / "head_config.json").read_text()))
    assert cfg.attention
    save_head(init_head(cfg, Engine.from_pretrained(target).target, seed=0), cfg, None, tmp_path / "untrained")
    untrained = _token_acceptance(target, tmp_path / "untrained", "eagle", prompts)
    assert acc[True] > untrained + 0.08, (acc, untrained)
    assert acc[True] > acc[False] - 0.03, acc


def test_profile_with_the_attention_head(tiny_eagles, tmp_path):
    """build_profile --draft HEAD_DIR with an attention head: its projections planned FP8, the profile's engine
    drafts with it, and its greedy output equals the planned target's."""
    from engine.cli.build_profile import main
    from quant.plan_io import plan_from_dict

    target, d = tiny_eagles
    out = tmp_path / "p.json"
    args = ["--gpu", "a100", "--target", str(target), "--draft", str(d / "True"), "--device", "cpu", "--quiet"]
    args += ["--eval-text", str(target.parent / "heldout.txt"), "--calib-text", str(target.parent / "calib.txt")]
    assert main([*args, "--max-eval-tokens", "2048", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["speculation"]["drafter"] == "eagle" and prof["models"]["draft"]["config"]["attention"]
    mods = prof["plan"]["draft"]["families"]["ffn"]["scaling"]["modules"]
    assert mods[0] == "fc" and "layers.0.self_attn.q_proj" in mods and "layers.0.mlp.down_proj" in mods
    eng = Engine.from_profile(out)
    assert eng.info["draft_head_fp8"] == mods and isinstance(eng.drafter.head, EagleAttnHead)
    planned = Engine.from_pretrained(
        target, precision=PrecisionConfig(plan_from_dict(prof["plan"]), (target.parent / "calib.txt").read_text())
    )
    prompts = ["The with statement", "A class definition", "import sys\n"]
    sp = SamplingParams(max_new_tokens=32)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in planned.generate(prompts, sp)]
    assert eng.stats()["accepted"] > 0


def test_fp8_plan_of_the_attention_head(ckpt_dir, attn_head, planned_plain):
    """The draft plan turns every Linear of the head (fc and the layer's projections) FP8; the planned bytes are
    what it stores; speculation with it stays lossless (the planned target's own greedy output)."""
    from test_head_fp8 import head_plan

    from quant.linear import FP8Linear

    plan = head_plan(ckpt_dir, attn_head)
    mods = plan.draft.families["ffn"].scaling["modules"]
    proj = ["q_proj", "k_proj", "v_proj", "o_proj"]
    mlp = ["gate_proj", "up_proj", "down_proj"]
    assert mods == ["fc", *[f"layers.0.self_attn.{p}" for p in proj], *[f"layers.0.mlp.{p}" for p in mlp]]
    eng = Engine.from_pretrained(
        ckpt_dir, attn_head, speculation=spec("eagle", 4), precision=PrecisionConfig(plan, None)
    )
    head = eng.drafter.head
    assert eng.info["draft_head_fp8"] == mods and all(isinstance(head.get_submodule(m), FP8Linear) for m in mods)
    stored = sum(m.weight_bytes() for m in head.modules() if isinstance(m, FP8Linear))
    stored += sum(p.numel() * 2 for n, p in head.named_parameters() if "norm" in n)
    assert plan.memory.draft_weight_bytes == stored
    assert [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))] == planned_plain
    assert eng.stats()["acceptance_rate"] > 0


@pytest.mark.skipif(small_gemm_status() is not None, reason=f"no CPU kernels: {small_gemm_status()}")
def test_cpu_kernel_equals_the_pytorch_layers(ckpt_dir, tmp_path):
    """``AttnHeadKernel`` (the decode step's forward_x) with fp32 weights: the same scores and features as the
    head's PyTorch forward, for a ragged batch in cache rows 2 and 0, then one more entry each."""
    from engine.core.model import fuse_projections
    from engine.kernels.cpu_head import AttnHeadKernel
    from engine.spec_decode.heads.modules import draft_lm_head

    eng = Engine.from_pretrained(ckpt_dir)
    path = random_head(ckpt_dir, tmp_path / "h", "eagle", attention=True)
    head = load_head(path, eng.target, eng.tokenizer.vocab(), "eagle")[0].float()
    lm = draft_lm_head(eng.target, None).weight
    fuse_projections(head)  # as the engine does before building the kernel
    kernel = AttnHeadKernel(head, lm, torch.float32)
    assert_head_kernel_matches(head, kernel, lambda h: h @ lm.T)


def test_attention_config_of_another_shape_refused(ckpt_dir, attn_head, tmp_path):
    """A config without the attention's shape, or with one its weights do not have, is refused at load."""
    import shutil

    from engine.core.errors import CheckpointError, DraftMismatchError

    bad = tmp_path / "bad"
    shutil.copytree(attn_head, bad)
    cfg = json.loads((attn_head / "head_config.json").read_text())
    (bad / "head_config.json").write_text(json.dumps({**cfg, "head_dim": 0}))
    with pytest.raises(CheckpointError, match="attention=true needs kind 'eagle' and attention_heads, kv_heads"):
        Engine.from_pretrained(ckpt_dir, bad, speculation=spec("eagle"))
    (bad / "head_config.json").write_text(json.dumps({**cfg, "attention_heads": cfg["attention_heads"] * 2}))
    needle = r"tensor layers.0.self_attn.o_proj.weight has shape \(64, 64\).*needs \(64, 128\)"
    with pytest.raises(DraftMismatchError, match=needle):
        Engine.from_pretrained(ckpt_dir, bad, speculation=spec("eagle"))


@pytest.mark.parametrize("cpu_pack", [True, False], ids=["cpu-kernel", "pytorch"])
def test_hidden_all_returns_every_position_and_scores_only_the_asked(ckpt_dir, cpu_pack):
    """``ForwardCall(features=Features.ALL)``: the features of every position of a cached pass, the logits of
    ``logits_idx`` only; both equal to what scoring every position returns."""
    from engine.core.model import KVCache

    eng = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=cpu_pack))
    t = eng.target
    toks = torch.tensor(eng.tokenizer.encode(TEXT[:40]))[None].repeat(2, 1)
    B, T = toks.shape
    pos = torch.arange(T).expand(B, T)
    idx = torch.tensor([[T - 3, T - 2, T - 1], [0, 1, 2]])
    with torch.no_grad():
        cache = KVCache(t.config, B, 64, torch.float32, "cpu")
        out = t.run(ForwardCall(toks, pos, cache, T, None, logits_idx=idx, features=Features.ALL))
        lg, h = out.logits, out.features
        every = torch.arange(T).expand(B, T)
        ref_cache = KVCache(t.config, B, 64, torch.float32, "cpu")
        ref = t.run(ForwardCall(toks, pos, ref_cache, T, None, every, features=Features.SCORED))
        ref_lg, ref_h = ref.logits, ref.features
    assert h.shape == (B, T, t.config.hidden_size) and lg.shape == (B, 3, t.config.vocab_size)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(lg, ref_lg.gather(1, idx[..., None].expand(-1, -1, lg.shape[-1])))

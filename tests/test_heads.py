"""Medusa and EAGLE-style draft heads: lossless (greedy identity, exact sampling), trained heads accept
better than untrained ones, and a head for another target or of another shape is refused at load."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from test_speculative import sampled_joint
from util import PROMPTS, TEXT, assert_greedy_grid, make_checkpoint

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, PrecisionConfig, SpeculationConfig
from engine.core.checkpoint import load_model
from engine.core.errors import DraftMismatchError, InvalidConfigError
from engine.core.model import Transformer
from engine.core.tokenizer import Tokenizer
from engine.kernels.cpu_gemm import small_gemm_status
from engine.kernels.cpu_head import (
    EagleKernel,
    MedusaKernel,
    head_gemm_weight,
    head_kernel_reason,
    head_store_dtype,
    scorer_on_kernel,
)
from engine.spec_decode.drafter import LoadedHead
from engine.spec_decode.drafters.eagle import EagleDrafter
from engine.spec_decode.drafters.medusa import MedusaDrafter
from engine.spec_decode.heads.checkpoint import load_head, save_head
from engine.spec_decode.heads.config import HeadConfig, target_fingerprint
from engine.spec_decode.heads.modules import draft_lm_head, init_head
from engine.train.distill import RunOptions, TrainOptions, train_draft
from quant.linear import FP8Linear
from quant.plan_io import plan_from_dict


def spec(kind: str, k: int = 5) -> SpeculationConfig:
    return SpeculationConfig(drafter=kind, k=k, k_policy="constant")


def random_head(
    target_dir, out, kind: str, draft_vocab: int | None = None, seed: int = 0, scale: float = 0.3, attention=False
):
    """A head with random weights (drafts that are sometimes right, sometimes wrong) for the target at target_dir."""
    eng = Engine.from_pretrained(target_dir)
    cfg = eng.target.config
    vocab_ids = (
        None if draft_vocab is None else torch.arange(0, cfg.vocab_size, cfg.vocab_size // draft_vocab)[:draft_vocab]
    )
    hcfg = HeadConfig(
        kind=kind,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        num_heads=4,
        draft_vocab=draft_vocab,
        attention=attention,
        attention_heads=cfg.num_attention_heads if attention else 0,
        kv_heads=cfg.num_key_value_heads if attention else 0,
        head_dim=cfg.head_dim if attention else 0,
        target=target_fingerprint(eng.target, eng.tokenizer.vocab()),
    )
    head = init_head(hcfg, eng.target, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    save_head(head, hcfg, vocab_ids, out)
    return out


@pytest.fixture(scope="module")
def trained_heads(ckpt_dir, tmp_path_factory):
    """Both kinds trained briefly by the tool on the test target's own text (full and reduced vocabulary)."""
    d = tmp_path_factory.mktemp("heads")
    out = {}
    for kind, dv in (("medusa", None), ("eagle", None), ("eagle", 128)):
        opts = TrainOptions(
            kind=kind, steps=60, samples=24, prompt_len=8, gen_len=40, positions=128, draft_vocab=dv, heads=3
        )
        path = d / f"{kind}-{dv}"
        train_draft(ckpt_dir, path, opts, TEXT * 4, RunOptions(progress=False))
        out[(kind, dv)] = path
    return out


@pytest.mark.parametrize("which", [("medusa", None), ("eagle", None), ("eagle", 128)], ids=str)
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_heads_equal_plain(ckpt_dir, trained_heads, plain, which, k):
    eng = Engine.from_pretrained(ckpt_dir, trained_heads[which], speculation=spec(which[0], k))
    assert_greedy_grid(eng, plain, which, k)
    s = eng.stats()
    assert s["drafted"] > 0 and 0 < s["acceptance_rate"] < 1  # both outcomes happened
    if which[0] == "medusa":
        outs = eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=40))
        assert all(len(o.stats["per_position_acceptance"]) <= 3 for o in outs)  # k capped at the 3 heads


def test_ragged_batch_with_mixed_requests(ckpt_dir, trained_heads, plain):
    """Requests joining mid-flight (no feature yet: no drafts for them in their first round), various lengths."""
    eng = Engine.from_pretrained(
        ckpt_dir, trained_heads[("eagle", None)], speculation=SpeculationConfig(drafter="eagle", k=3)
    )
    lens = [40, 7, 25, 40, 13, 40]
    reqs = [eng.submit(PROMPTS[i], SamplingParams(max_new_tokens=n)) for i, n in enumerate(lens)]
    outs = [r.result() for r in reqs]
    assert [o.token_ids for o in outs] == [plain[i][:n] for i, n in enumerate(lens)]


needs_kernel = pytest.mark.skipif(small_gemm_status() is not None, reason=f"no CPU kernels: {small_gemm_status()}")


@needs_kernel
@pytest.mark.parametrize("draft_vocab", [None, 128])
def test_eagle_step_on_the_cpu_kernel(ckpt_dir, trained_heads, draft_vocab):
    """The head's C++ step (16-bit GEMM weights: the draft's rounding; the LM head's fp32 rows) computes
    PyTorch's step on those weights, and its greedy call drafts what the step and argmax do in a loop."""
    target = load_model(ckpt_dir)
    module, cfg, ids = load_head(trained_heads[("eagle", draft_vocab)], target, Tokenizer(ckpt_dir).vocab(), "eagle")
    weights = module.kernel_weights(head_gemm_weight)
    store = head_store_dtype([w for w in weights if w.dim() == 2], None)
    assert store == torch.float16  # trained fp32 weights: not exact in bf16, the draft rounds to fp16
    lm = draft_lm_head(target, ids).weight
    kernel = EagleKernel(weights, target.embed_tokens.weight, lm, ids, cfg.rms_norm_eps, store)
    ref_module = copy.deepcopy(module)
    with torch.no_grad():
        for m in ref_module.modules():
            if type(m) is torch.nn.Linear:
                m.weight.copy_(m.weight.to(store).float())
    ref = EagleDrafter(LoadedHead(ref_module, cfg, ids), target, draft_lm_head(target, ids))
    f, tok = torch.randn(3, cfg.hidden_size), torch.tensor([5, 17, 2])
    with torch.no_grad():
        for got, want in zip(kernel(f, tok), ref.step(f, tok)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        drafts, g, t = [], f, tok
        for _ in range(4):
            g, logits = kernel(g, t)
            t = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
            drafts.append(t)
        assert torch.equal(kernel.greedy(f, tok, 4), torch.stack(drafts, 1))
    shared = [target.embed_tokens.weight, lm]
    assert head_kernel_reason(weights, shared) is None
    assert head_kernel_reason(weights, [w.half() for w in shared]) is None  # a CPU plan's fp16 verifier
    quantized = [None if w.dim() == 2 else w for w in weights]  # what kernel_weights gives for native FP8 Linears
    assert "activation scaling" in head_kernel_reason(quantized, shared)
    assert "head's tensors in float32" in head_kernel_reason([*weights[:-1], weights[-1].half()], shared)
    assert "contiguous on the CPU" in head_kernel_reason(weights, [shared[0], lm.T])
    assert head_store_dtype(weights, "float32") == torch.float32
    with pytest.raises(ValueError, match="store='int8' is invalid"):
        head_store_dtype(weights, "int8")


@needs_kernel
@pytest.mark.parametrize("draft_vocab", [None, 64])
def test_medusa_step_on_the_cpu_kernel(ckpt_dir, trained_heads, draft_vocab):
    """Medusa's C++ step (16-bit head weights, the LM head's fp32 rows) computes PyTorch's step on those
    weights, its greedy call their argmaxes; the PyTorch step's scorer on the few-row GEMM reads the target's
    fp32 weight itself."""
    target = load_model(ckpt_dir)
    module, cfg, _ = load_head(trained_heads[("medusa", None)], target, Tokenizer(ckpt_dir).vocab(), "medusa")
    ids = None if draft_vocab is None else torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    lm = draft_lm_head(target, ids).weight
    weight, bias = module.kernel_weights(head_gemm_weight)
    kernel = MedusaKernel(weight, bias, lm, ids, cfg.vocab_size, torch.bfloat16)
    ref_module = copy.deepcopy(module)
    with torch.no_grad():
        ref_module.weight.copy_(ref_module.weight.bfloat16().float())
    ref = MedusaDrafter(LoadedHead(ref_module, cfg, ids), target, draft_lm_head(target, ids))
    f = torch.randn(2, cfg.hidden_size)
    with torch.no_grad():
        logits = kernel(f, 3)
        torch.testing.assert_close(logits, ref.step(f, 3), rtol=1e-4, atol=1e-4)
        best = logits.argmax(-1)
        assert torch.equal(kernel.greedy(f, 3), best if ids is None else ids[best])
    assert head_kernel_reason([weight, bias], [lm]) is None
    scorer = scorer_on_kernel(draft_lm_head(target, None))
    assert scorer.weight.data_ptr() == target.lm_head.weight.data_ptr()  # the verifier's fp32 weight, not a copy
    x = torch.randn(3, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(scorer(x), x @ target.lm_head.weight.T, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_engine_puts_the_head_step_on_the_kernel(ckpt_dir, trained_heads, plain, kind):
    head = trained_heads[(kind, None)]
    for opts, want in (
        (KernelOptions(), "float16"),
        (KernelOptions(draft_step_weights="bfloat16"), "bfloat16"),
        (KernelOptions(cpu_pack=False), None),  # PyTorch's ops throughout
    ):
        eng = Engine.from_pretrained(ckpt_dir, head, speculation=spec(kind, 4), kernels=opts)
        assert eng.info["draft_head_step_weights"] == want
        assert (eng.drafter.greedy is not None) == (want is not None)
        outs = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))]
        assert outs == plain and eng.stats()["acceptance_rate"] > 0


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    kw = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "eos_token_id": None}
    return make_checkpoint(d / "t", seed=3, **kw), d


@pytest.mark.parametrize("kind,draft_vocab", [("medusa", None), ("eagle", None), ("eagle", 8)])
def test_sampled_heads_match_the_target_distribution(small_pair, kind, draft_vocab, attention=False):
    target, d = small_pair
    head = random_head(
        target, d / f"{kind}-{draft_vocab}-{attention}", kind, draft_vocab, scale=1.0, attention=attention
    )
    eng = Engine.from_pretrained(target, head, speculation=spec(kind, 2))
    sp = SamplingParams(max_new_tokens=3, temperature=1.0)
    # the first token comes from the prefill (no feature yet, no drafts), the second is drafted by the head
    counts, exact, pvalue = sampled_joint(eng, [1, 2, 3], sp, 30_000, 3_000)
    assert counts[exact == 0].sum() == 0
    assert 0.05 < eng.stats()["acceptance_rate"] < 0.95
    assert pvalue > 1e-4


def test_head_refused_for_another_target(ckpt_dir, small_pair, trained_heads, tmp_path):
    head = trained_heads[("eagle", None)]
    with pytest.raises(DraftMismatchError, match="hidden_size 64 != the target's 32"):
        Engine.from_pretrained(small_pair[0], head, speculation=spec("eagle"))
    # same shapes, other weights (another seed): the embedding probe tells them apart
    other = make_checkpoint(tmp_path / "other", "llama", num_hidden_layers=4, seed=11)
    with pytest.raises(DraftMismatchError, match="embed_probe"):
        Engine.from_pretrained(other, head, speculation=spec("eagle"))
    with pytest.raises(DraftMismatchError, match="kind='eagle', but the drafter is 'medusa'"):
        Engine.from_pretrained(ckpt_dir, head, speculation=spec("medusa"))
    with pytest.raises(InvalidConfigError, match="needs a head directory"):
        Engine.from_pretrained(ckpt_dir, None, speculation=spec("eagle"))


def test_head_of_the_wrong_shape_refused(ckpt_dir, trained_heads, tmp_path):
    from safetensors.torch import load_file, save_file

    src = trained_heads[("medusa", None)]
    bad = tmp_path / "bad"
    bad.mkdir()
    t = load_file(str(src / "model.safetensors"))
    t["weight"] = t["weight"][:, :2]  # 2 heads in the weights, 3 in the config
    save_file(t, str(bad / "model.safetensors"))
    (bad / "head_config.json").write_text((src / "head_config.json").read_text())
    with pytest.raises(DraftMismatchError, match=r"tensor weight has shape \(1, 2, 64, 64\).*needs \(1, 3, 64, 64\)"):
        Engine.from_pretrained(ckpt_dir, bad, speculation=spec("medusa"))
    cfg = json.loads((src / "head_config.json").read_text())
    cfg["vocab_size"] = 301
    (bad / "head_config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftMismatchError, match="vocab_size 301 != the target's 300"):
        Engine.from_pretrained(ckpt_dir, bad, speculation=spec("medusa"))


def _token_acceptance(target, head, kind, prompts) -> float:
    eng = Engine.from_pretrained(target, head, speculation=spec(kind, 4))
    eng.generate(prompts, SamplingParams(max_new_tokens=48))
    return eng.stats()["token_acceptance"]


def _first_draft_acceptance(target, head, kind, prompts) -> float:
    """Acceptance of the first draft position, sampled (temperature 0.8, seeded): the tiny target's greedy text
    falls into runs of one token that an untrained head (the target's own LM head) drafts as well."""
    eng = Engine.from_pretrained(target, head, speculation=spec(kind, 4))
    eng.generate(prompts, [SamplingParams(max_new_tokens=48, temperature=0.8, seed=i) for i in range(len(prompts))])
    t = eng.scheduler.snapshot()["totals"]
    return t.pos_accepted[0] / t.pos_tried[0]


@pytest.fixture(scope="module")
def tiny_heads(tiny_demo, tmp_path_factory):
    """Heads trained in seconds on the tiny demo target's own text (prompts from its calibration slice)."""
    target, _ = tiny_demo
    d = tmp_path_factory.mktemp("tiny-heads")
    train = (target.parent / "calib.txt").read_text(encoding="utf-8")
    for kind in ("medusa", "eagle"):
        opts = TrainOptions(kind=kind, steps=150, samples=48, prompt_len=16, gen_len=64, heads=3)
        train_draft(target, d / kind, opts, train, RunOptions(progress=False))
    return target, d


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_trained_head_accepts_better_than_untrained(tiny_heads, tmp_path, kind):
    target, d = tiny_heads
    ids = Tokenizer(target).encode((target.parent / "heldout.txt").read_text(encoding="utf-8"))
    prompts = [ids[i : i + 24] for i in range(0, 300 * 16, 300)]  # held-out prompts (never trained on)
    cfg = HeadConfig(**json.loads((d / kind / "head_config.json").read_text()))
    untrained = tmp_path / "untrained"
    save_head(init_head(cfg, Engine.from_pretrained(target).target, seed=0), cfg, None, untrained)
    a_trained = _first_draft_acceptance(target, d / kind, kind, prompts)
    a_untrained = _first_draft_acceptance(target, untrained, kind, prompts)
    # ~400 first drafts tested per run: a standard error of ~0.035 on the difference
    assert a_trained > a_untrained + 0.08, (a_trained, a_untrained)


def test_profile_with_a_head(tiny_heads, tmp_path):
    """build_profile --draft HEAD_DIR: gate and calibration as for a draft model; the profile's engine drafts
    with the head and its greedy output equals the target's."""
    from engine.cli.build_profile import main

    target, d = tiny_heads
    out = tmp_path / "p.json"
    rc = main(
        [
            "--gpu",
            "a100",
            "--target",
            str(target),
            "--draft",
            str(d / "eagle"),
            "--device",
            "cpu",
            "--quiet",
            "--eval-text",
            str(target.parent / "heldout.txt"),
            "--calib-text",
            str(target.parent / "calib.txt"),
            "--max-eval-tokens",
            "2048",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["speculation"]["drafter"] == "eagle" and prof["models"]["draft"]["config"]["kind"] == "eagle"
    # the head is the draft: its Linears planned FP8 (a100: weight-only), the shared LM head left to the verifier
    dplan = prof["plan"]["draft"]
    assert dplan["head"] == "eagle" and dplan["families"]["ffn"]["storage"] == "fp8_e4m3"
    assert dplan["families"]["ffn"]["scaling"]["modules"] == ["fc", "gate_up.0", "down.0"]
    assert dplan["families"]["lm_head"]["storage"] == "fp32" and dplan["families"]["embeddings"]["storage"] == "fp32"
    assert 0 < prof["memory"]["draft"]["bytes"] < prof["memory"]["draft"]["fp16_bytes"]
    assert "acceptance_fp16_draft" in prof["speculation"]  # the unquantized head measured beside it
    eng = Engine.from_profile(out)
    assert eng.stats()["drafter"] == "eagle"
    assert eng.info["draft_head_fp8"] == ["fc", "gate_up.0", "down.0"]
    fc = eng.drafter.head.fc
    assert isinstance(fc, FP8Linear) and fc.kernel == "weight-only" and fc.weight.dtype == torch.float8_e4m3fn
    plain = Engine.from_pretrained(
        target,
        precision=PrecisionConfig(plan_from_dict(prof["plan"]), (target.parent / "calib.txt").read_text()),
    )
    prompts = ["The with statement", "A class definition", "import sys\n"]
    sp = SamplingParams(max_new_tokens=32)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]
    assert eng.stats()["accepted"] > 0


def test_train_a_draft_model(ckpt_dir, plain, tmp_path):
    """--kind model: a Hugging Face draft checkpoint with the target's tokenizer, usable as the model drafter;
    weight_values="bfloat16" writes fp32 tensors that hold bf16 values (as the demo pair's draft)."""
    from safetensors.torch import load_file

    opts = TrainOptions(
        kind="model", steps=20, samples=16, prompt_len=8, gen_len=32, layers=1, hidden=64, weight_values="bfloat16"
    )
    out = tmp_path / "draft"
    rep = train_draft(ckpt_dir, out, opts, TEXT * 4, RunOptions(progress=False))
    assert rep["steps"] == 20 and not (out / "train_state.pt").exists() and not (out / "distill_data.pt").exists()
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert all(torch.equal(t, t.bfloat16().float()) for t in tensors.values())
    eng = Engine.from_pretrained(ckpt_dir, out, speculation=spec("model", 3))
    assert [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))] == plain
    assert eng.stats()["drafted"] > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--greedy-share", "2"], "greedy_share=2.0 is invalid: allowed 0.0 .. 1.0"),
        (["--samples", "0"], "samples=0 is invalid: allowed an int >= 1"),
        (["--heldout", "-1"], "heldout=-1 is invalid: allowed an int >= 0"),
        (["--attention"], "attention=True is invalid with kind='model': allowed with kind='eagle'"),
        (["--weight-values", "int4"], "--weight-values: invalid choice: 'int4' (choose from 'float32', 'bfloat16'"),
    ],
)
def test_train_draft_tool_refuses_bad_options(ckpt_dir, tmp_path, capsys, args, needle):
    """One line naming the option and what is allowed, exit 2, nothing written."""
    from engine.cli.train_draft import main

    out = tmp_path / "out"
    assert main(["--target", str(ckpt_dir), "--kind", "model", "--out", str(out), "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specmix-train-draft: ") and needle in err[0]
    assert not out.exists()


def test_interrupted_training_resumes_where_it_stopped(tmp_path):
    """An interrupt after the state saved at step 10 resumes at step 10 and ends with the weights of an
    uninterrupted run (weights, optimizer and RNG restored)."""
    from engine.train.distill import train_loop

    def run(state, stop_at=None):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        calls = []

        def loss_fn(g):
            calls.append(1)
            if stop_at is not None and len(calls) > stop_at:
                raise KeyboardInterrupt
            x = torch.randn(8, 4, generator=g)
            return (m(x) - x.flip(-1)).pow(2).mean()

        opts = TrainOptions(kind="medusa", steps=20, save_every=10, warmup=2)
        try:
            train_loop(m, loss_fn, opts, 20, state, progress=False)
        except KeyboardInterrupt:
            return None, len(calls)
        return m.weight.detach().clone(), len(calls)

    ref, n = run(tmp_path / "a.pt")
    assert n == 20
    assert run(tmp_path / "b.pt", stop_at=15)[0] is None and (tmp_path / "b.pt").is_file()
    resumed, n = run(tmp_path / "b.pt")
    assert n == 10 and torch.equal(resumed, ref)


def test_a_saved_state_of_other_options_is_refused(tmp_path):
    """A state saved by a run of another shape (another draft vocabulary: another LM head) is refused, naming the
    tensor and both shapes, before any training step."""
    from engine.core.errors import InvalidConfigError
    from engine.train.distill import train_loop

    opts = TrainOptions(kind="medusa", steps=4, save_every=2, warmup=1)
    state = tmp_path / "s.pt"
    m, calls = torch.nn.Linear(4, 6, bias=False), []

    def stops_at_step_3(g):
        calls.append(1)
        if len(calls) == 3:  # after the state of step 2 was saved
            raise KeyboardInterrupt
        return m(torch.randn(2, 4, generator=g)).pow(2).mean()

    with pytest.raises(KeyboardInterrupt):
        train_loop(m, stops_at_step_3, opts, 4, state, progress=False)
    assert state.is_file()
    other = torch.nn.Linear(4, 5, bias=False)
    with pytest.raises(InvalidConfigError, match=r"weight: saved \(6, 4\), this run \(5, 4\)"):
        train_loop(other, lambda g: other(torch.randn(2, 4, generator=g)).sum(), opts, 4, state, progress=False)


def test_bench_modes_of_trained_heads(tiny_heads, tmp_path, capsys):
    """tools/bench.py --medusa/--eagle: a mode per head (with its measured draft cost) and, with --sweep-k,
    each head at fixed K; every mode's greedy output equals plain decoding."""
    from engine.cli.bench import main

    target, d = tiny_heads
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(n):\nThe with statement\n", encoding="utf-8")
    argv = ["--target", str(target), "--medusa", str(d / "medusa"), "--eagle", str(d / "eagle")]
    argv += ["--prompts", str(prompts), "--repeats", "1", "--max-new-tokens", "8", "--no-hf", "--threads", "1"]
    argv += ["--modes", "specmix-medusa,specmix-eagle", "--sweep-k", "2", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    capsys.readouterr()
    modes = {m["name"]: m for m in json.loads((tmp_path / "r.json").read_text())["modes"]}
    assert set(modes) == {"plain", "specmix-medusa", "specmix-eagle", "specmix-medusa-k2", "specmix-eagle-k2"}
    for name in ("specmix-medusa", "specmix-eagle"):
        assert modes[name]["costs"]["c"] > 0 and modes[name]["mean_accepted_length"] >= 1
    for name in ("specmix-medusa-k2", "specmix-eagle-k2"):
        assert modes[name]["fixed_k"] == 2 and 1 <= modes[name]["mean_accepted_length"] <= 3
    assert all(m["match_vs_plain"]["identical"] == 1.0 for m in modes.values())


def test_bench_reports_the_costs_of_a_mode_whose_rounds_never_drafted(tiny_heads, tmp_path, capsys, monkeypatch):
    """Where the K tuner runs plain rounds only (speculation lost to plain decoding at batch 1), a head's mode
    still reports its measured draft cost, and no acceptance or predicted speedup."""
    from engine.cli.bench import main
    from engine.runtime.k_tuner import PLAIN, KTuner

    monkeypatch.setattr(KTuner, "choose", lambda self, batch, acceptance: PLAIN)
    target, d = tiny_heads
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(n):\n", encoding="utf-8")
    argv = ["--target", str(target), "--medusa", str(d / "medusa"), "--prompts", str(prompts), "--repeats", "1"]
    argv += ["--max-new-tokens", "6", "--no-hf", "--threads", "1", "--modes", "specmix-medusa"]
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    mode = {m["name"]: m for m in json.loads((tmp_path / "r.json").read_text())["modes"]}["specmix-medusa"]
    assert mode["costs"]["c"] > 0 and mode["token_acceptance"] is None and mode["mean_accepted_length"] == 1
    assert mode["predicted_speedup"] is None


def _dir_files(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_interrupted_head_save_never_leaves_a_config_beside_other_weights(ckpt_dir, tmp_path, monkeypatch):
    """Saving a head of another shape over a head: a failure while the weights are written leaves the old head
    whole (and loadable); a failure before the config is written leaves no config, so the directory is refused
    as no head, never read as the old config over the new weights. A save that completes loads."""
    import dataclasses

    import engine.core.files as files
    import engine.spec_decode.heads.checkpoint as ckpt
    from engine.core.errors import CheckpointError

    d = random_head(ckpt_dir, tmp_path / "head", "medusa")
    before = _dir_files(d)
    eng = Engine.from_pretrained(ckpt_dir)
    _, cfg, _ = load_head(d, eng.target, eng.tokenizer.vocab(), "medusa")
    new_cfg = dataclasses.replace(cfg, num_heads=2)
    new_head = init_head(new_cfg, eng.target, seed=1)

    def partial_then_fail(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)  # a torn write
        raise OSError("injected: disk full")

    with monkeypatch.context() as m:
        m.setattr(ckpt, "save_file", partial_then_fail)
        with pytest.raises(OSError, match="injected"):
            save_head(new_head, new_cfg, None, d)
    assert _dir_files(d) == before  # the old head as it was, no temp file beside it
    assert load_head(d, eng.target, eng.tokenizer.vocab(), "medusa")[1] == cfg

    def no_config(path, text):
        raise OSError("injected: killed before the config")

    with monkeypatch.context() as m:
        m.setattr(files, "write_text_atomic", no_config)
        with pytest.raises(OSError, match="injected"):
            save_head(new_head, new_cfg, None, d)
    assert sorted(p.name for p in d.iterdir()) == ["model.safetensors"]
    with pytest.raises(CheckpointError, match="head_config.json is missing"):
        Engine.from_pretrained(ckpt_dir, d, speculation=spec("medusa"))
    save_head(new_head, new_cfg, None, d)
    assert load_head(d, eng.target, eng.tokenizer.vocab(), "medusa")[1] == new_cfg


def test_interrupted_draft_model_save_leaves_no_config(ckpt_dir, draft_dir, tmp_path, monkeypatch):
    """A draft model written over another one: killed before its config.json, the directory has no config (it is
    refused as no checkpoint) and complete weights; the save run again gives a loadable draft."""
    import engine.core.files as files
    from engine.core.errors import CheckpointError
    from engine.train.distill import draft_model_config, save_draft_model

    out = tmp_path / "draft"
    shutil.copytree(draft_dir, out)
    cfg = draft_model_config(load_model(ckpt_dir).config, 1, 64)
    torch.manual_seed(0)
    draft = Transformer(cfg)

    def no_config(path, text):
        raise OSError("injected: killed before the config")

    with monkeypatch.context() as m:
        m.setattr(files, "write_text_atomic", no_config)
        with pytest.raises(OSError, match="injected"):
            save_draft_model(draft, ckpt_dir, out)
    assert not (out / "config.json").exists() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(out)
    save_draft_model(draft, ckpt_dir, out)
    loaded = load_model(out)
    assert loaded.config.num_hidden_layers == 1 and all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), draft.state_dict().values())
    )


@pytest.mark.parametrize("which", [("eagle", None), ("eagle", 128)], ids=str)
@pytest.mark.parametrize("branches,k", [(2, 4), (3, 8)])
def test_greedy_eagle_trees_equal_plain(ckpt_dir, trained_heads, plain, which, branches, k):
    """EAGLE-2 dynamic trees (the head's top children of its most probable nodes) verified in one masked pass:
    token-identical to plain decoding, the reduced draft vocabulary included."""
    spec = SpeculationConfig(drafter="eagle", k=k, k_policy="constant", tree_branches=branches)
    eng = Engine.from_pretrained(ckpt_dir, trained_heads[which], speculation=spec)
    assert_greedy_grid(eng, plain, which, branches, k)
    assert eng.stats()["accepted"] > 0


def test_greedy_eagle_trees_with_prompt_lookup_first_equal_plain(ckpt_dir, trained_heads, plain):
    """Copies (chains) and the head's trees in one batch: token-identical to plain decoding."""
    spec = SpeculationConfig(drafter="eagle", k=6, k_policy="constant", tree_branches=3, prompt_lookup_min=2)
    eng = Engine.from_pretrained(ckpt_dir, trained_heads[("eagle", None)], speculation=spec)
    assert_greedy_grid(eng, plain, "eagle tree + lookup")
    assert eng.stats()["accepted"] > 0

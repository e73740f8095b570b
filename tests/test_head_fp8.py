"""The FP8 draft plan on trained heads (quant/head_plan.py) and CUDA graphs of a head's step (emulated here;
tests/test_gpu_device.py captures them on CUDA): the quantized Linears within FP8 error of their fp32
references, speculation still lossless, acceptance close to the fp32 head's, the plan in a profile."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from test_heads import random_head, spec, tiny_heads  # noqa: F401 (fixtures)
from util import PROMPTS

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, PrecisionConfig, SpeculationConfig
from engine.core.config import load_config
from engine.core.errors import InvalidConfigError, ProfileError
from engine.core.tokenizer import Tokenizer
from engine.kernels.cpu_gemm import small_gemm_status
from engine.spec_decode.heads.checkpoint import load_head
from engine.spec_decode.heads.config import read_head_config
from quant.catalog import lookup_gpu
from quant.head_plan import MEDUSA_KEPT, apply_head_plan
from quant.linear import FP8Linear
from quant.plan import make_plan
from quant.plan_io import plan_from_dict

FP16_TARGET = {"draft_model": "fp8", "main_model": {"attention": "fp16", "ffn": "fp16"}, "verifier": "fp16"}
TOL = {"native": 0.06, "weight-only": 0.045}  # as tests/test_quant_kernels.py: e4m3 rounding, ~2.5% rms per operand
GREEDY = SamplingParams(max_new_tokens=40)


def head_plan(target, head_dir, gpu: str = "a100"):
    """A CPU plan whose draft part is the head's; the target unquantized (its FFN fp16), read back from JSON."""
    hc = dataclasses.asdict(read_head_config(head_dir))
    plan = make_plan(lookup_gpu(gpu), load_config(target), None, FP16_TARGET, device="cpu", draft_head=hc)
    return plan_from_dict(json.loads(plan.to_json()))


@pytest.fixture(scope="module")
def heads(ckpt_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8-heads")
    return {kind: random_head(ckpt_dir, d / kind, kind) for kind in ("medusa", "eagle")}


@pytest.mark.parametrize("gpu,kernel", [("a100", "weight-only"), ("h100", "native")])
def test_fp8_eagle_linears_within_fp8_error(ckpt_dir, heads, gpu, kernel):
    plan = head_plan(ckpt_dir, heads["eagle"], gpu)
    ffn = plan.draft.families["ffn"]
    assert plan.draft.head == "eagle" and (ffn.storage, ffn.kernel) == ("fp8_e4m3", kernel)
    assert ffn.scaling["modules"] == ["fc", "gate_up.0", "down.0"]
    assert not plan.draft.families["lm_head"].quantized and "target's" in plan.draft.families["lm_head"].reason
    eng = Engine.from_pretrained(ckpt_dir)
    ref, _, _ = load_head(heads["eagle"], eng.target, eng.tokenizer.vocab())
    head = copy.deepcopy(ref)
    assert apply_head_plan(head, plan.draft) == ffn.scaling["modules"]
    g = torch.Generator().manual_seed(0)
    for name in ffn.scaling["modules"]:
        q, lin = head.get_submodule(name), ref.get_submodule(name)
        assert isinstance(q, FP8Linear) and q.kernel == kernel and q.weight.dtype == torch.float8_e4m3fn
        x = torch.randn(16, lin.in_features, generator=g)
        err = float((q(x) - lin(x)).norm() / lin(x).norm())
        assert 1e-4 < err <= TOL[kernel], (name, err)  # quantized (not the fp32 weights), within FP8 error
    # the whole step too: the head's next feature from (feature, embedding)
    f, e = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    assert float((head(f, e) - ref(f, e)).norm() / ref(f, e).norm()) <= 0.1
    # the planned bytes are what the quantized head stores (no shared table counted)
    stored = sum(m.weight_bytes() for m in head.modules() if isinstance(m, FP8Linear))
    stored += sum(p.numel() * 2 for n, p in head.named_parameters() if "norm" in n)  # the plan's fp16 norms
    assert plan.memory.draft_weight_bytes == stored < plan.memory.draft_fp16_bytes


def test_medusa_kept_unquantized_and_said_so(ckpt_dir, heads):
    plan = head_plan(ckpt_dir, heads["medusa"])
    ffn = plan.draft.families["ffn"]
    assert plan.draft.head == "medusa" and not ffn.quantized and ffn.reason == MEDUSA_KEPT
    assert any(MEDUSA_KEPT in n for n in plan.notes)
    assert plan.memory.draft_weight_bytes == plan.memory.draft_fp16_bytes > 0
    eng = Engine.from_pretrained(
        ckpt_dir, heads["medusa"], speculation=spec("medusa", 3), precision=PrecisionConfig(plan, None)
    )
    assert eng.info["draft_head_fp8"] == [] and not any(isinstance(m, FP8Linear) for m in eng.drafter.head.modules())


@pytest.mark.parametrize("k", [2, 5])
def test_fp8_head_greedy_equals_plain(ckpt_dir, heads, planned_plain, k):  # noqa: F811
    plan = head_plan(ckpt_dir, heads["eagle"], "h100")
    eng = Engine.from_pretrained(
        ckpt_dir, heads["eagle"], speculation=spec("eagle", k), precision=PrecisionConfig(plan, None)
    )
    assert eng.info["draft_head_fp8"] == ["fc", "gate_up.0", "down.0"]
    assert isinstance(eng.drafter.head.fc, FP8Linear)
    assert eng.target.lm_head.weight.dtype == torch.float16  # the shared LM head: the verifier's fp16, not FP8
    assert (
        plan.target.families
        == make_plan(lookup_gpu("h100"), load_config(ckpt_dir), None, FP16_TARGET, device="cpu").target.families
    )
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == planned_plain
    assert eng.stats()["drafted"] > 0


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_under_a_plan_with_measured_k_and_with_emulated_graphs(ckpt_dir, heads, planned_plain, kind):
    """The plan stores the shared LM head in fp16: the heads' features stay in the target's fp32 (the measured K
    policy times a draft step on them) and their scorer widens the rows on whatever kernel runs it (emulated graphs
    keep PyTorch's ops)."""
    plan = head_plan(ckpt_dir, heads[kind], "h100")
    measured = SpeculationConfig(drafter=kind, k=3)  # the default policy: "measured"
    graphs = KernelOptions(cuda_graphs=True, batch_buckets=(1, 2), emulate_graphs=True)
    for speculation, kernels in ((measured, KernelOptions()), (spec(kind, 3), graphs)):
        eng = Engine.from_pretrained(
            ckpt_dir, heads[kind], speculation=speculation, precision=PrecisionConfig(plan, None), kernels=kernels
        )
        assert eng.target.lm_head.weight.dtype == torch.float16 and eng.drafter.feature_dtype == torch.float32
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == planned_plain
        assert eng.stats()["drafted"] > 0


@pytest.mark.skipif(small_gemm_status() is not None, reason=f"no CPU kernels: {small_gemm_status()}")
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_fp16_head_under_a_plan_keeps_its_cpu_step(ckpt_dir, heads, planned_plain, kind):
    """A plan whose draft stays 16-bit (draft_model fp16): the head's C++ step reads the target's fp16 LM head rows
    (and eagle its fp16 embedding) as stored, and speculation keeps the planned target's greedy output."""
    hc = dataclasses.asdict(read_head_config(heads[kind]))
    fp16_draft = {**FP16_TARGET, "draft_model": "fp16"}
    plan = make_plan(lookup_gpu("h100"), load_config(ckpt_dir), None, fp16_draft, device="cpu", draft_head=hc)
    eng = Engine.from_pretrained(ckpt_dir, heads[kind], speculation=spec(kind, 3), precision=PrecisionConfig(plan))
    assert eng.target.lm_head.weight.dtype == torch.float16
    assert eng.info["draft_head_step_weights"] is not None and eng.drafter.greedy is not None  # the C++ step
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == planned_plain
    assert eng.stats()["drafted"] > 0


@pytest.mark.skipif(small_gemm_status() is not None, reason=f"no CPU kernels: {small_gemm_status()}")
def test_a_weight_only_fp8_head_runs_its_cpu_step_and_a_native_one_stays_on_pytorch(ckpt_dir, heads, planned_plain):
    """The a100 plan's FP8 head (weight-only: fp16 activations on e4m3 weights) runs its one-call C++ step on its
    weights dequantized once (a 16-bit copy, not a per-call fp32 one); the h100 plan's (native: activations scaled
    per token) keeps PyTorch's ops, which compute it. Both keep the planned target's greedy output."""
    for gpu, kernel in (("a100", "weight-only"), ("h100", "native")):
        plan = head_plan(ckpt_dir, heads["eagle"], gpu)
        assert plan.draft.families["ffn"].kernel == kernel
        precision = PrecisionConfig(plan)
        eng = Engine.from_pretrained(ckpt_dir, heads["eagle"], speculation=spec("eagle", 3), precision=precision)
        assert isinstance(eng.drafter.head.fc, FP8Linear)
        on_kernel = eng.drafter.greedy is not None
        assert on_kernel == (kernel == "weight-only") == (eng.info["draft_head_step_weights"] is not None)
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == planned_plain
        assert eng.stats()["drafted"] > 0


def test_plan_and_drafter_mismatch_refused(ckpt_dir, draft_dir, heads):
    medusa_plan = head_plan(ckpt_dir, heads["medusa"])
    with pytest.raises(InvalidConfigError, match="plan.draft.head='medusa' but the head is a 'eagle' head"):
        Engine.from_pretrained(
            ckpt_dir, heads["eagle"], speculation=spec("eagle"), precision=PrecisionConfig(medusa_plan, None)
        )
    with pytest.raises(InvalidConfigError, match="made for a medusa head, but the draft is a model"):
        Engine.from_pretrained(
            ckpt_dir, draft_dir, speculation=spec("model"), precision=PrecisionConfig(medusa_plan, None)
        )
    model_plan = make_plan(lookup_gpu("a100"), load_config(ckpt_dir), load_config(draft_dir), FP16_TARGET, device="cpu")
    with pytest.raises(InvalidConfigError, match="made for a draft model, but the draft is a eagle head"):
        Engine.from_pretrained(
            ckpt_dir, heads["eagle"], speculation=spec("eagle"), precision=PrecisionConfig(model_plan, None)
        )
    d = json.loads(head_plan(ckpt_dir, heads["eagle"]).to_json())
    d["draft"]["head"] = "hydra"
    with pytest.raises(
        ProfileError, match=r"plan.draft.head='hydra' is invalid: allowed medusa, eagle, eagle3 or null"
    ):
        plan_from_dict(d)
    d["draft"]["head"], d["draft"]["families"]["lm_head"]["storage"] = "eagle", "fp8_e4m3"
    d["draft"]["families"]["lm_head"]["kernel"] = "native"
    with pytest.raises(ProfileError, match="the LM head and embeddings are the target's"):
        plan_from_dict(d)


def test_fp8_head_acceptance_close_to_fp32(tiny_heads):  # noqa: F811
    target, d = tiny_heads
    ids = Tokenizer(target).encode((target.parent / "heldout.txt").read_text(encoding="utf-8"))
    prompts = [ids[i : i + 24] for i in range(0, 600 * 8, 600)]  # held-out prompts
    acc = {}
    for name, precision in (("fp32", None), ("fp8", PrecisionConfig(head_plan(target, d / "eagle", "h100"), None))):
        eng = Engine.from_pretrained(target, d / "eagle", speculation=spec("eagle", 4), precision=precision)
        eng.generate(prompts, SamplingParams(max_new_tokens=48))
        acc[name] = eng.stats()["token_acceptance"]
    assert acc["fp32"] > 0.2, acc  # a trained head: the comparison means something
    assert abs(acc["fp8"] - acc["fp32"]) <= 0.05, acc


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_emulated_head_graphs_give_the_eager_output(ckpt_dir, heads, plain, kind):  # noqa: F811
    kernels = KernelOptions(cuda_graphs=True, batch_buckets=(1, 2), emulate_graphs=True)
    eng = Engine.from_pretrained(ckpt_dir, heads[kind], speculation=spec(kind, 3), kernels=kernels)
    target_runner, step_runner = eng.cuda_graphs
    assert eng.loop.target is target_runner and eng.drafter.runner is step_runner
    outs = [o.token_ids for o in eng.generate(PROMPTS[:2], GREEDY)]  # batch 2: graphed
    outs += [o.token_ids for o in eng.generate(PROMPTS[2:], GREEDY)]  # batch 3 > 2: eager
    assert outs == plain
    st = step_runner.stats
    assert st.captures > 0 and st.replays > 0 and st.eager_calls > 0
    assert {k.batch for k in step_runner._graphs} <= {1, 2}
    if kind == "medusa":  # one graph per number of heads asked (K, or fewer near max_new_tokens)
        assert {k.static for k in step_runner._graphs} >= {(3,)}
    assert any(k.hidden for k in target_runner._graphs)  # the verify returning features was graphed
    total = eng.stats()["cuda_graphs"]
    assert total["replays"] == target_runner.stats.replays + st.replays and total["emulated"]

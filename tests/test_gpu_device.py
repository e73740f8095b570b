"""The GPU path on a CUDA device (``-m gpu``; skipped without one): attention, CUDA graphs, NVML, FP8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from util import GPU_GREEDY_TOKENS
from util import GPU_PROMPTS as PROMPTS
from util import reference_attention as math_attention

from engine import Engine, SamplingParams
from engine.api.assemble import Models, parts_from_models
from engine.api.options import (
    KernelOptions,
    Limits,
    LoadWindowConfig,
    SpeculationConfig,
)
from engine.core.attention import sdpa_attention
from engine.core.forward import ForwardCall
from engine.core.model import KVCache
from engine.kernels.backends import (
    FlashAttention,
)
from engine.kernels.cudagraphs import GraphedForward

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=GPU_GREEDY_TOKENS, temperature=0.0)


def _ids(outs):
    return [o.token_ids for o in outs]


def _cc() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _tokenizer():
    """A 300-id byte-level tokenizer (tokenizers only) in a fresh directory."""
    import tempfile

    from util import make_tokenizer

    from engine.core.tokenizer import Tokenizer

    d = Path(tempfile.mkdtemp(prefix="gpu-tok-"))
    make_tokenizer(d, 300)
    return Tokenizer(d)


def _gpu_engine(
    dtype: torch.dtype = torch.float32, k: int = 3, graphs: bool = False, load_window: bool = False
) -> Engine:
    """A random target (GQA) and draft built on the GPU, peaked (std 0.08) so greedy has no near-ties."""
    from engine.cli import gpu_bench
    from engine.core.config import ModelConfig

    def cfg(h, layers):
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=300,
            hidden_size=h,
            intermediate_size=2 * h,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=h // 4,
            max_position_embeddings=1024,
        )

    dev = torch.device("cuda")
    t = gpu_bench.random_model(cfg(128, 3), dtype, dev, 0, std=0.08)
    d = gpu_bench.random_model(cfg(64, 1), dtype, dev, 1, std=0.08)
    parts = parts_from_models(
        Models(t, _tokenizer(), d, vocab=300),
        SpeculationConfig(drafter="model", k=k, k_policy="constant", k_max=k),
        KernelOptions(cuda_graphs=graphs),
        dev,
    )
    return Engine(parts, Limits(max_batch=8, load_window=LoadWindowConfig() if load_window else None))


@pytest.mark.gpu
def test_gpu_sdpa_forms_agree_fp16():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 8, 5, 64, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(4, 8, 300, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    dense = torch.ones(5, 300, dtype=torch.bool, device="cuda").tril(295)[None, None].expand(4, 1, 5, 300)
    ref = math_attention(q, k, v, dense).float()
    for out in (sdpa_attention(q, k, v, dense, False), sdpa_attention(q, k, v, None, True)):
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.gpu
def test_gpu_flash_attn_agrees_with_sdpa_fp16():
    pytest.importorskip("flash_attn")
    if _cc() < (8, 0):
        pytest.skip("flash-attn 2 needs compute capability >= 8.0")
    from engine.core.attention import _Ctx, position_mask

    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc = (torch.randn(4, 4, 256, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    q = torch.randn(2, 8, 3, 64, device="cuda", dtype=torch.float16, generator=g)
    pos = torch.tensor([[40, 41, 42], [100, 101, 102]], device="cuda")
    rows = torch.tensor([3, 0], device="cuda")
    ctx = _Ctx(pos, rows, False, 103, position_mask(pos, 103, None))
    out = FlashAttention().with_cache(q, kc, vc, ctx, None)
    want = sdpa_attention(q, kc[rows, :, :103], vc[rows, :, :103], ctx.mask, False)
    assert out is not None and ((out.float() - want.float()).norm() / want.float().norm()).item() <= 1e-2
    plain = FlashAttention()(q, kc[:2, :, :3], vc[:2, :, :3], None, True)
    ref = sdpa_attention(q, kc[:2, :, :3], vc[:2, :, :3], None, True)
    assert ((plain.float() - ref.float()).norm() / ref.float().norm()).item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_graph_replay_equals_eager_token_for_token(batch):
    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 1] * (i % 3) for i in range(batch)]  # ragged
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    eager = _gpu_engine()
    graphed = _gpu_engine(graphs=True)
    assert _ids(graphed.generate(prompts, params)) == _ids(eager.generate(prompts, params))
    st = graphed.stats()["cuda_graphs"]
    assert st["captures"] > 0 and st["capture_seconds"] > 0 and st["replays"] > 0 and not st["emulated"]


@pytest.mark.gpu
def test_gpu_graph_logits_match_eager_fp16():
    eng = _gpu_engine(torch.float16)
    m = eng.target
    cache = KVCache(m.config, 4, 256, torch.float16, "cuda")
    toks = torch.randint(0, 300, (3, 20), device="cuda")
    m(toks, torch.arange(20, device="cuda").expand(3, 20), cache, 20)
    runner = GraphedForward(m, (1, 2, 4), max_tokens=9)
    blk = torch.randint(0, 300, (3, 5), device="cuda")
    pos = (20 + torch.arange(5, device="cuda")).expand(3, 5)
    idx = torch.arange(5, device="cuda").expand(3, 5)
    call = ForwardCall(blk, pos, cache, 25, logits_idx=idx)
    a = m.run(call).logits.float()
    b = runner.run(call).logits.float()
    b2 = runner.run(call).logits.float()  # a replay of the captured graph
    assert ((a - b).norm() / a.norm()).item() <= 1e-2 and torch.equal(b, b2)
    assert runner.stats.captures == 1 and runner.stats.replays == 2


@pytest.mark.gpu
def test_gpu_nvml_readings_present():
    pytest.importorskip("pynvml")
    from engine.runtime.telemetry import NvmlReader

    r = NvmlReader(torch.device("cuda"))
    reading = r.read()
    assert 0 < reading.used_bytes <= reading.total_bytes and 0 <= reading.utilization_pct <= 100
    eng = _gpu_engine(load_window=True)
    assert eng.scheduler.governor is not None
    st = eng.stats()
    assert st["gpu"]["source"] == "nvml" and st["gpu"]["memory_total_bytes"] == reading.total_bytes
    assert st["load_window"]["memory_threshold"] == 0.8


@pytest.mark.gpu
def test_gpu_native_fp8_draft_agrees_with_weight_only():
    if _cc() < (8, 9):
        pytest.skip("native FP8 needs compute capability >= 8.9 (Ada/Hopper)")
    from engine.cli import gpu_bench
    from quant.fp8 import FP8_REL_ERROR
    from quant.linear import FP8Linear

    cfg = gpu_bench.shape("llama-68m")
    draft = gpu_bench.random_model(cfg, torch.float16, torch.device("cuda"), 1)
    gpu_bench.swap_linears(draft, lambda lin: FP8Linear.from_float(lin, "native"), gpu_bench.LINEARS, lm_head=True)
    toks = torch.randint(0, cfg.vocab_size, (4, 16), device="cuda")
    with torch.no_grad():
        native = draft(toks).float()
        for mod in draft.modules():
            if isinstance(mod, FP8Linear):
                mod.set_kernel("weight-only")
        weight_only = draft(toks).float()
    rel = ((native - weight_only).norm() / weight_only.norm()).item()
    assert torch.isfinite(native).all() and rel <= 2 * FP8_REL_ERROR  # only the per-token activation rounding
    assert F.cosine_similarity(native.flatten(), weight_only.flatten(), dim=0).item() >= 0.99


def _gpu_head(kind: str, target, seed: int = 0):
    """A random head (3 heads / 1 block) on the target's device and dtype, loaded as from a checkpoint."""
    from engine.spec_decode.drafter import LoadedHead
    from engine.spec_decode.heads.config import HeadConfig
    from engine.spec_decode.heads.modules import init_head

    H = target.config.hidden_size
    cfg = HeadConfig(kind=kind, hidden_size=H, vocab_size=target.config.vocab_size, num_heads=3)
    head = init_head(cfg, target, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.3 / p.shape[-1] ** 0.5)
    head = head.to(device=target.norm.weight.device, dtype=target.dtype).eval().requires_grad_(False)
    return LoadedHead(head, cfg, None)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_gpu_head_step_graphs_equal_eager(kind):
    """The head drafter's step captured per batch bucket (and the verify returning features): greedy output
    token for token the eager engine's, ragged batches included."""
    from engine.cli import gpu_bench
    from engine.core.config import ModelConfig
    from engine.kernels.head_graphs import GraphedStep

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
    )
    dev = torch.device("cuda")
    t = gpu_bench.random_model(cfg, torch.float32, dev, 0, std=0.08)
    head = _gpu_head(kind, t)
    sc = SpeculationConfig(drafter=kind, k=3, k_policy="constant", k_max=3)

    def engine(graphs: bool) -> Engine:
        models = Models(t, _tokenizer(), head=head, vocab=300)
        return Engine(parts_from_models(models, sc, KernelOptions(cuda_graphs=graphs), dev), Limits(max_batch=8))

    prompts = [PROMPTS[i % len(PROMPTS)] + [i + 1] * (i % 3) for i in range(5)]
    params = SamplingParams(max_new_tokens=48, temperature=0.0)
    graphed = engine(True)
    assert _ids(graphed.generate(prompts, params)) == _ids(engine(False).generate(prompts, params))
    runner = graphed.cuda_graphs[-1]
    assert isinstance(runner, GraphedStep) and graphed.drafter.runner is runner
    assert runner.stats.captures > 0 and runner.stats.capture_seconds > 0 and runner.stats.replays > 0
    assert not runner.emulate and graphed.stats()["drafted"] > 0


@pytest.mark.gpu
def test_gpu_fp8_eagle_step_graph_matches_eager_fp16():
    """An FP8 eagle head (the plan's draft part; native FP8 from sm_89, weight-only below) replayed from a
    captured graph at a padded batch equals its eager step."""
    from engine.cli import gpu_bench
    from engine.kernels.head_graphs import GraphedStep
    from engine.spec_decode.drafters.eagle import EagleDrafter
    from engine.spec_decode.heads.modules import draft_lm_head
    from quant.catalog import lookup_gpu
    from quant.head_plan import apply_head_plan
    from quant.linear import FP8Linear
    from quant.plan import make_plan

    cfg = gpu_bench.shape("llama-68m")
    t = gpu_bench.random_model(cfg, torch.float16, torch.device("cuda"), 0)
    drafter = EagleDrafter(_gpu_head("eagle", t), t, draft_lm_head(t, None))
    kernel = "native" if _cc() >= (8, 9) else "weight-only"
    hc = {k: getattr(drafter.cfg, k) for k in ("kind", "hidden_size", "vocab_size", "layers", "intermediate_size")}
    hc |= {"num_heads": drafter.cfg.num_heads, "draft_vocab": None}
    plan = make_plan(lookup_gpu("h100"), cfg, None, draft_head=hc, fp8_kernel=kernel)
    assert apply_head_plan(drafter.head, plan.draft) == ["fc", "gate_up.0", "down.0"]
    assert isinstance(drafter.head.fc, FP8Linear) and drafter.head.fc.kernel == kernel
    runner = GraphedStep(drafter.step, torch.device("cuda"), (1, 2, 4))
    f = torch.randn(3, cfg.hidden_size, device="cuda", dtype=torch.float16)
    tok = torch.randint(0, cfg.vocab_size, (3,), device="cuda")
    with torch.no_grad():
        ef, el = drafter.step(f, tok)
        gf, gl = runner(f, tok)
        gf2, gl2 = runner(f, tok)  # a replay of the captured graph
    assert runner.stats.captures == 1 and runner.stats.replays == 2
    assert torch.equal(gl, gl2) and torch.isfinite(gl).all()
    assert ((gl.float() - el.float()).norm() / el.float().norm()).item() <= 1e-2
    assert ((gf.float() - ef.float()).norm() / ef.float().norm()).item() <= 1e-2


@pytest.mark.gpu
def test_gpu_graphs_survive_a_kv_cache_swap():
    """A long request after a short one grows the KV cache, which drops every graph; the graphs captured again
    into the shared pool give the eager engine's tokens."""
    eager, graphed = _gpu_engine(), _gpu_engine(graphs=True)
    for n in (8, 300):
        params = SamplingParams(max_new_tokens=n, temperature=0.0)
        assert _ids(graphed.generate(PROMPTS[:2], params)) == _ids(eager.generate(PROMPTS[:2], params)), n
    assert graphed.stats()["cuda_graphs"]["resets"] >= 1

"""The CPU's INT8 kernels (engine/kernels/cpu_int8.py, csrc/int8_gemm.cpp) against fp32 references: the few-row
int8 GEMM equals the fp32 kernel on the dequantized weight bit for bit (per channel and per group of 32, 64, 128,
odd shapes, 1 to 64 rows) and stays within a bound of the fp32 matmul; the C++ W8A8 equals the plan's w8a8;
the decode step runs a model with INT8 FFNs (mixed groupings, one W8A8 with SmoothQuant) like its PyTorch
forward, a verify block equals its one-token steps, no dense copy of an INT8 weight is held after a forward,
the engine's greedy output with speculation equals plain decoding on the planned model, and the plan's fp16
attention is held and read in fp16."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from util import PROMPTS, assert_step_like_pytorch

from engine import Engine, SamplingParams
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.core.checkpoint import load_model
from engine.core.model import KVCache, fuse_projections
from engine.core.stored_linear import StoredEmbedding
from engine.kernels.cpu_decode import DecodeStep, install_decode_step
from engine.kernels.cpu_gemm import cpu_kernels, small_gemm_status
from engine.kernels.cpu_int8 import install_int8_row_kernels, uses_int8_amx
from engine.kernels.cpu_linear import fast_cpu_linears
from engine.kernels.memory import resident_weight_bytes
from quant.catalog import lookup_gpu
from quant.int8 import dequant_linear, dequantize_int8, dequantize_int8_groupwise
from quant.linear import Int8Linear
from quant.plan import make_plan

STATUS = small_gemm_status()
pytestmark = pytest.mark.skipif(STATUS is not None, reason=f"fp32 CPU kernels unavailable: {STATUS}")
GROUPS = (None, 32, 64, 128)
ROWS = (1, 2, 3, 4, 5, 6, 8, 17, 33, 64)  # around the direct-read | scratch switch: 3 | 4, on AMX cores 5 | 6


def _dequant(mod: Int8Linear) -> torch.Tensor:
    if mod.group_size is None:
        return dequantize_int8(mod.weight, mod.weight_scale)
    return dequantize_int8_groupwise(mod.weight, mod.weight_scale, mod.group_size)


def _int8(n: int, k: int, group: int | None, kernel: str = "w8a16", seed: int = 0) -> tuple[nn.Linear, Int8Linear]:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    act = torch.rand(k, generator=g) * 4 + 0.1 if kernel == "w8a8" else None
    return lin, Int8Linear.from_float(lin, kernel=kernel, group_size=group, act_absmax=act)


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("shape", [(37, 100), (64, 1000), (96, 576), (9, 130)])
def test_int8_gemm_is_the_fp32_kernel_on_the_dequantized_weight(group, shape):
    n, k = shape
    lin, mod = _int8(n, k, group)
    k_ = cpu_kernels()
    wd = _dequant(mod)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = k_.int8_gemm(x, mod.weight, mod.weight_scale, group or 0)
        assert torch.equal(y, k_.small_gemm(x, wd)), (shape, group, m)  # bit for bit, any row count
        ref = x.double() @ lin.weight.detach().double().t()  # the fp32 matmul of the unquantized weight
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 0.02


@pytest.mark.parametrize("smooth", [False, True])
def test_w8a8_kernel_equals_the_plans_w8a8(smooth):
    _, mod = _int8(48, 200, None, "w8a8" if smooth else "w8a16")
    if not smooth:
        mod.set_kernel("w8a8")
    sm = mod.smooth if smooth else torch.empty(0)
    for m in ROWS:
        x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)) * 3
        with torch.no_grad():
            assert torch.equal(cpu_kernels().w8a8_gemm(x, mod.weight, mod.weight_scale, sm), mod(x)), m


@pytest.mark.parametrize("group", GROUPS)
def test_int8_linear_on_the_cpu_keeps_no_dense_copy(group):
    lin, mod = _int8(70, 192, group)
    x = torch.randn(80, 192)
    with torch.no_grad():
        y_tiles = mod(x)  # no row kernel: dequantized a tile at a time
        assert torch.allclose(y_tiles, x @ _dequant(mod).t(), rtol=1e-5, atol=1e-6)
        assert install_int8_row_kernels(nn.Sequential(mod)) == 1
        amx = uses_int8_amx(nn.Sequential(mod))  # on AMX-INT8 tiles where this CPU has them (test_int8_amx.py)
        for m in (1, 4, 32):  # the row kernel: the int8 GEMM's bits (the fp32 kernel's on the dequantized weight)
            xm = x[:m].contiguous()
            want = cpu_kernels().small_gemm(xm, _dequant(mod))
            if amx:
                want = cpu_kernels().int8_amx_gemm(xm, mod.weight, mod.weight_scale, group or 0)
            assert torch.equal(mod(x[:m]), want)
        assert torch.equal(mod(x), y_tiles)  # over MAX_ROWS: the tiles again
    assert not mod.kernel_state  # nothing cached beside the int8 weight
    assert torch.equal(dequant_linear(x, mod.weight, mod.weight_scale, group), y_tiles)


def _int8_ffn(model: nn.Module) -> None:
    """Mixed groupings per layer (gate and up differ, so the step stacks them) and one W8A8 down_proj."""
    for i, layer in enumerate(model.layers):
        m = layer.mlp
        gs = [(32, 64, None), (128, None, 32), (None, 64, 64), (64, 32, 128)][i % 4]
        m.gate_proj = Int8Linear.from_float(m.gate_proj, "w8a16", group_size=gs[0])
        m.up_proj = Int8Linear.from_float(m.up_proj, "w8a16", group_size=gs[1])
        if i == 1:
            act = m.down_proj.weight.detach().abs().amax(0) + 0.5
            m.down_proj = Int8Linear.from_float(m.down_proj, "w8a8", act_absmax=act)
        else:
            m.down_proj = Int8Linear.from_float(m.down_proj, "w8a16", group_size=gs[2])


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    from util import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("i8"), "llama", num_hidden_layers=4, intermediate_size=256)
    m = load_model(path, torch.float32)
    ref = load_model(path, torch.float32)
    _int8_ffn(m)
    _int8_ffn(ref)
    fuse_projections(m)
    assert fast_cpu_linears(m, torch.device("cpu"), True)[0] > 0
    assert install_decode_step(m) is None and isinstance(m.layer_step, DecodeStep)
    return m, ref


def test_decode_step_runs_int8_layers_like_pytorch(int8_model):
    m, ref = int8_model
    assert not m.layer_step.int8_amx  # groups of 32 among its INT8 Linears: all on the AVX-512 int8 GEMM
    assert_step_like_pytorch(m, ref)  # and a verify block equals its one-token steps bit for bit


def test_no_dense_copy_of_an_int8_weight_after_a_forward(int8_model):
    m, _ = int8_model
    with torch.no_grad():
        m(torch.randint(0, m.config.vocab_size, (1, 5)), cache=KVCache(m.config, 1, 16, torch.float32, "cpu"), kv_len=5)
        m(torch.randint(0, m.config.vocab_size, (1, 40)))  # a no-cache forward: the tile path
    shapes = {tuple(mod.weight.shape) for mod in m.modules() if isinstance(mod, Int8Linear)}
    held = [*m.parameters(), *m.buffers(), *m.layer_step.tensors]
    held += [t for mod in m.modules() if isinstance(mod, Int8Linear) for t in mod.kernel_state.values()]
    dense = [t for t in held if t.is_floating_point() and t.dim() == 2 and tuple(t.shape) in shapes]
    assert not dense
    stacked = {(2 * 256, 64), (64, 256)}  # gate/up stacked: their weights are views, not copies
    assert not [t for t in held if t.is_floating_point() and tuple(t.shape) in stacked]
    int8 = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, Int8Linear))
    fp32_ffn = 4 * int8
    assert resident_weight_bytes(m) < sum(p.numel() * 4 for p in m.parameters() if p.dtype == torch.float32) + (
        fp32_ffn
    )


@pytest.mark.parametrize("group", [32, None])  # per channel: on AMX-INT8 tiles where the CPU has them
def test_speculation_is_greedy_identical_on_the_int8_plan(ckpt_dir, group):
    cfg = load_model(ckpt_dir, torch.float32).config
    plan = make_plan(lookup_gpu("a100"), cfg, None, device="cpu", int8_kernel="w8a16", group_size=group)
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    outs = []
    for spec in (SpeculationConfig(), SpeculationConfig(drafter="ngram", k=4)):
        eng = Engine.from_pretrained(ckpt_dir, precision=PrecisionConfig(plan=plan), speculation=spec)
        assert eng.info["cpu_decode_step"] == ["target"]
        assert eng.info["target_step_int8_amx"] == (group is None and not cpu_kernels().int8_amx_status())
        outs.append([o.token_ids for o in eng.generate(PROMPTS[:3], params)])
        mem = eng.stats()["memory"]
        assert mem["target_weight_bytes"] == resident_weight_bytes(eng.target)
    assert outs[0] == outs[1]


def test_the_plans_fp16_attention_and_verifier_are_stored_and_read_in_fp16(ckpt_dir):
    """A CPU plan keeps its fp16 attention, embeddings and LM head in fp16 (q/k/v fused as views of one 16-bit
    weight; a tied table shared) and the decode step reads those tensors as they are: no fp32 copy of any of them,
    the PyTorch forward's logits."""
    ref = load_model(ckpt_dir, torch.float32)
    cfg = ref.config
    plan = make_plan(lookup_gpu("a100"), cfg, None, device="cpu", int8_kernel="w8a16", group_size=32)
    eng = Engine.from_pretrained(ckpt_dir, precision=PrecisionConfig(plan=plan))
    t = eng.target
    attn = t.layers[0].self_attn
    assert attn.o_proj.weight.dtype == torch.float16 and attn.qkv.weight.dtype == torch.float16
    assert torch.equal(attn.q_proj.weight, ref.layers[0].self_attn.q_proj.weight.half())  # rounded to nearest
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()  # a view of the fused weight
    assert isinstance(t.embed_tokens, StoredEmbedding)
    assert torch.equal(t.embed_tokens.weight, ref.embed_tokens.weight.half())
    assert t.lm_head.weight.dtype == torch.float16
    assert (t.lm_head.weight.data_ptr() == t.embed_tokens.weight.data_ptr()) == cfg.tie_word_embeddings
    step = t.layer_step
    held = {x.data_ptr() for x in step.tensors}
    stored = (attn.qkv.weight, attn.o_proj.weight, t.embed_tokens.weight, t.lm_head.weight)
    assert all(w.data_ptr() in held for w in stored)  # read as stored
    shapes = {tuple(w.shape) for w in stored}
    assert not [x for x in [*t.parameters(), *step.tensors] if x.dtype == torch.float32 and tuple(x.shape) in shapes]
    toks = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cached = t(toks, cache=KVCache(cfg, 2, 32, torch.float32, "cpu"), kv_len=9)
        plain = t(toks)  # the no-cache forward (the quality gate's)
    assert cached.dtype == torch.float32 and torch.allclose(cached, plain, rtol=1e-4, atol=1e-4)


def test_stats_count_the_kernels_copies(tmp_path):
    from util import make_checkpoint

    path = make_checkpoint(tmp_path / "bf16", "llama", values=torch.bfloat16)  # the step copies its GEMMs to bf16
    eng = Engine.from_pretrained(path)
    assert eng.info["target_step_weights"] == "bfloat16"
    params = sum(p.numel() * p.element_size() for p in {*eng.target.parameters(), *eng.target.buffers()})
    copies = sum(t.numel() * t.element_size() for t in eng.target.layer_step.tensors if t.dtype == torch.bfloat16)
    assert copies > 0 and eng.stats()["memory"]["target_weight_bytes"] == params + copies

"""The AMX tile kernel for bf16-valued weights (engine/kernels/csrc/amx_gemm.cpp) against float64 and against the
AVX-512 small-GEMM kernel on the same weights (its fallback, same inputs and outputs); rows independent
bit for bit at every row count, 16-row chunks included; the decode step on it."""

from __future__ import annotations

import pytest
import torch
from util import make_checkpoint

from engine.api.options import SpeculationConfig
from engine.core.checkpoint import load_model
from engine.core.errors import KernelUnavailableError
from engine.core.model import KVCache, fuse_projections
from engine.kernels.cpu_decode import (
    DecodeStep,
    exact_weight_dtype,
    install_decode_step,
)
from engine.kernels.cpu_gemm import amx_status, cpu_kernels

STATUS = amx_status()
pytestmark = pytest.mark.skipif(STATUS is not None, reason=f"AMX tiles unavailable: {STATUS}")


@pytest.mark.parametrize("K,N", [(768, 2304), (2048, 768), (100, 37), (33, 17), (32, 16), (1, 1)])
def test_matches_float64_and_the_avx512_kernel_with_independent_rows(K, N):
    g = torch.Generator().manual_seed(K * N)
    w = (torch.randn(N, K, generator=g) / K**0.5).bfloat16()
    x = torch.randn(40, K, generator=g) * 3  # 40 rows: tiles of 5 rows, passes of up to 3 tiles (15 rows)
    k = cpu_kernels()
    packed = k.amx_pack(w)
    got = k.amx_gemm(x, packed, N)
    want = x.double() @ w.double().T
    # an fp32 dot product of exact inputs: within a few fp32 roundings of the true value
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1e-30)
    assert ((got.double() - want).abs() / scale).max() < 2e-6
    torch.testing.assert_close(got, k.small_gemm(x, w), rtol=1e-5, atol=1e-5)
    for m in (0, 5, 15, 16, 17, 39):  # each row alone == the same row inside a 40-row call
        assert torch.equal(k.amx_gemm(x[m : m + 1].contiguous(), packed, N), got[m : m + 1])
    assert torch.equal(k.amx_gemm(x[3:9].contiguous(), packed, N), got[3:9])


def test_inputs_are_split_exactly():
    """Inputs that need all 24 bits, the largest floats, infinities and NaNs of any payload come out of a
    one-term dot product (w = 1) exactly as they went in; below ~1e-31 the last bits drop (the tiles flush
    subnormal parts), below 2^-126 the input counts as zero."""
    k = cpu_kernels()
    bits = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0x7FC00000], dtype=torch.int64).to(torch.int32)
    special = torch.cat(
        [
            torch.tensor(
                [
                    1 + 2**-23,
                    -(1 + 2**-9 + 2**-17 + 2**-23),
                    3.0,
                    1e-3,
                    3.4028235e38,
                    -3.3961776e38,
                    float("inf"),
                    float("-inf"),
                    1e-30,
                    -0.0,
                ]
            ),
            bits.view(torch.float32),
        ]
    )
    x = torch.cat([special, torch.randn(2000) * torch.logspace(-20, 30, 2000)])[:, None].contiguous()
    one = k.amx_pack(torch.ones(1, 1, dtype=torch.bfloat16))
    got = k.amx_gemm(x, one, 1)
    assert torch.equal(got[:10], x[:10]) and got[10:14].isnan().all()
    assert torch.equal(got[14:], x[14:])
    tiny = torch.tensor([[2.0**-110 * (1 + 2**-20)], [2.0**-127]])
    assert torch.equal(k.amx_gemm(tiny, one, 1), torch.tensor([[2.0**-110], [0.0]]))


def test_bad_input_is_refused():
    k = cpu_kernels()
    with pytest.raises(RuntimeError, match="amx_pack: a bfloat16 CPU matrix"):
        k.amx_pack(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match=r"amx_gemm: a packed weight of \[20, 8\]"):
        k.amx_gemm(torch.randn(2, 8), k.amx_pack(torch.randn(4, 8).bfloat16()), 20)
    with pytest.raises(RuntimeError, match=r"amx_gemm: a packed weight of \[4, 40\]"):
        k.amx_gemm(torch.randn(2, 40), k.amx_pack(torch.randn(4, 8).bfloat16()), 4)
    with pytest.raises(RuntimeError, match=r"amx_gemm: a packed weight of \[16, 32\]"):  # not packed
        k.amx_gemm(torch.randn(2, 32), torch.randn(16, 32).bfloat16(), 16)


def test_decode_step_on_tiles(tmp_path):
    """A bf16-valued model's step runs on the tiles by default: close to the PyTorch forward, a block of
    tokens equal to one-token steps bit for bit; amx=True needs bf16 storage."""
    m = load_model(make_checkpoint(tmp_path / "m", "llama", num_hidden_layers=2), torch.float32)
    fuse_projections(m)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.bfloat16().float())
    assert exact_weight_dtype(m) == torch.bfloat16
    assert install_decode_step(m) is None and m.layer_step.amx
    with pytest.raises(ValueError, match="amx=True is invalid with weight_dtype=torch.float32"):
        DecodeStep(m, torch.float32, amx=True)
    toks = torch.randint(0, m.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        c1, c2 = (KVCache(m.config, 2, 32, torch.float32, "cpu") for _ in range(2))
        full = m(toks, cache=c1, kv_len=20)
        step, m.layer_step = m.layer_step, None
        ref = m(toks, cache=c2, kv_len=20)
        m.layer_step = step
        torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c1.k, c2.k, rtol=1e-4, atol=1e-4)
        c3 = KVCache(m.config, 2, 32, torch.float32, "cpu")
        m(toks[:, :12], cache=c3, kv_len=12)
        steps = [
            m(toks[:, i : i + 1], input_pos=pos[:, i : i + 1], cache=c3, kv_len=i + 1, start=i) for i in range(12, 20)
        ]
    assert torch.equal(torch.cat(steps, 1), full[:, 12:])


def test_unavailable_tiles_are_said(tmp_path, monkeypatch):
    import engine.kernels.cpu_decode as cd

    m = load_model(make_checkpoint(tmp_path / "m", "llama", num_hidden_layers=1), torch.float32)
    fuse_projections(m)
    monkeypatch.setattr(cd, "amx_status", lambda: "the CPU has no AMX-BF16 tiles")
    with pytest.raises(KernelUnavailableError, match="AMX tiles are unavailable: the CPU has no AMX-BF16 tiles"):
        DecodeStep(m, torch.bfloat16, amx=True)
    assert not DecodeStep(m, torch.bfloat16).amx  # the AVX-512 kernel instead


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A target and a draft (its weights plus noise) whose weights are bf16 values, like a bf16 checkpoint."""
    root = tmp_path_factory.mktemp("bf16")
    return (
        make_checkpoint(root / "t", "llama", num_hidden_layers=3, values=torch.bfloat16),
        make_checkpoint(root / "d", "llama", num_hidden_layers=3, perturb=0.005, values=torch.bfloat16),
    )


def test_engine_runs_a_bf16_checkpoint_on_tiles_and_speculation_stays_exact(bf16_pair):
    """The engine finds the lossless bf16 storage, runs the target's step on AMX tiles, and greedy
    speculation (every K, alone and batched) reproduces its plain output token for token, which is
    transformers' greedy output of the same checkpoint."""
    import transformers as tf

    from engine import Engine, SamplingParams

    target, draft = bf16_pair
    prompts = [[5, 17, 33], [200, 3, 3, 9, 41, 7], [88], [1, 2, 3, 4, 5, 6, 7, 8]]
    sp = SamplingParams(max_new_tokens=20)
    plain = Engine.from_pretrained(target)
    assert plain.info["target_step_weights"] == "bfloat16" and plain.info["target_step_amx"] is True
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    hf = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for p, w in zip(prompts, want):
        out = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
        assert out[0, len(p) :].tolist() == w
    for drafter, k in [("model", 2), ("model", 5), ("early-exit", 3)]:
        eng = Engine.from_pretrained(
            target,
            draft if drafter == "model" else None,
            speculation=SpeculationConfig(drafter=drafter, k=k, k_policy="constant"),
        )
        if drafter == "model":  # a bf16-valued draft: its step on tiles too (lossless: the default)
            assert eng.info["draft_step_weights"] == "bfloat16" and eng.info["draft_step_amx"] is True
        assert [eng.generate([p], sp)[0].token_ids for p in prompts] == want, (drafter, k)
        assert [o.token_ids for o in eng.generate(prompts, sp)] == want, (drafter, k)


def test_two_engines_on_tiles_in_two_threads_give_their_sequential_outputs(bf16_pair):
    """Each OS thread configures its own tiles: two engines generating at once (their C++ calls release
    the GIL) give exactly what each gives alone."""
    import threading

    from engine import Engine, SamplingParams

    target, draft = bf16_pair
    sp = SamplingParams(max_new_tokens=16)
    prompts = [[5, 17, 33], [200, 3, 3, 9], [88, 1], [7, 7, 7, 7, 2]]
    engines = [
        Engine.from_pretrained(target),
        Engine.from_pretrained(target, draft, speculation=SpeculationConfig(k=3)),
    ]
    want = [[o.token_ids for o in e.generate(prompts, sp)] for e in engines]
    got: list = [None, None]

    def run(i):
        got[i] = [[o.token_ids for o in engines[i].generate([p], sp)][0] for p in prompts * 3]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] == want[0] * 3 and got[1] == want[1] * 3 and want[0] == want[1]

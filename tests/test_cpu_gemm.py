"""The fp32 small-GEMM CPU kernel (engine/kernels/cpu_gemm.py) against F.linear (its fallback, same API) in float64,
row independence bit for bit, the module swap and the engine's choice of kernel."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from util import fused_gemm_count

from engine import Engine, SamplingParams
from engine.api.options import KernelOptions, SpeculationConfig
from engine.core.checkpoint import load_model
from engine.core.errors import InvalidConfigError, KernelUnavailableError
from engine.kernels.cpu_gemm import (
    MAX_ROWS,
    SmallGemmFused,
    SmallGemmLinear,
    small_gemm_kernel,
    small_gemm_status,
)
from engine.kernels.cpu_linear import fast_cpu_linears, small_gemm_linears

STATUS = small_gemm_status()
needs_kernel = pytest.mark.skipif(STATUS is not None, reason=f"small-GEMM kernel unavailable: {STATUS}")


def test_the_kernels_build_wherever_the_machine_can_build_them():
    """Only a machine without the means (not x86-64, no AVX2, no compiler or ninja) may skip the kernel tests: a
    compile error in engine/kernels/csrc fails here instead of skipping every test of the kernels it breaks."""
    assert STATUS is None or not STATUS.startswith("the build failed"), STATUS


@needs_kernel
@pytest.mark.parametrize("K,N", [(768, 2304), (100, 37), (17, 9), (16, 8), (2048, 13), (1, 5)])
def test_kernel_matches_linear_in_float64_and_rows_are_independent(K, N):
    g = torch.Generator().manual_seed(K * 31 + N)
    x = torch.randn(MAX_ROWS + 3, K, generator=g)
    w = torch.randn(N, K, generator=g) / K**0.5
    gemm = small_gemm_kernel()
    full = gemm(x, w)
    want = (x.double() @ w.double().T).float()
    # fp32 accumulation of K products: within a few ulps of the float64 result, like F.linear
    tol = 4 * K**0.5 * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().T).max().item()
    assert (full - want).abs().max().item() <= tol
    assert (F.linear(x, w) - want).abs().max().item() <= tol
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, MAX_ROWS):  # any row count: each row comes out bit for bit the same
        assert torch.equal(gemm(x[:rows].contiguous(), w), full[:rows])
    assert torch.equal(gemm(x[5:6].contiguous(), w), full[5:6])


@needs_kernel
@pytest.mark.parametrize("M", [129, 130, 301])
def test_a_prompt_runs_in_passes_of_rows_with_the_same_bits(M):
    """At K = 2048 a pass over the weights takes 128 input rows (1 MiB): 129, 130 and 301 rows run in two or three
    passes, the last of one or two rows or a full tile, and each row is the one a single-row call computes."""
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 2048, generator=g), torch.randn(40, 2048, generator=g) / 2048**0.5
    gemm = small_gemm_kernel()
    full = gemm(x, w)
    assert (full - (x.double() @ w.double().T).float()).abs().max().item() < 1e-4
    for m in (0, 127, 128, M - 1):
        assert torch.equal(gemm(x[m : m + 1].contiguous(), w), full[m : m + 1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(256, 768), (100, 37), (17, 9), (1, 5)])
def test_16_bit_weights_are_widened_exactly(K, N, dtype):
    """fp16 and bf16 weights (the draft's step storage; a bf16 checkpoint's target) give the kernel's
    fp32-weight result bit for bit on the same values: the widening is exact, the accumulation the
    same, K tails included; and match float64 like the fp32 kernel does."""
    g = torch.Generator().manual_seed(K + N)
    x = torch.randn(7, K, generator=g)
    w16 = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    gemm = small_gemm_kernel()
    got = gemm(x, w16)
    assert torch.equal(got, gemm(x, w16.float()))
    assert torch.equal(gemm(x[:1].contiguous(), w16), got[:1])
    torch.testing.assert_close(got.double(), x.double() @ w16.double().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        gemm(x, w16.to(torch.float64))


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_small_gemm_linear_has_the_api_of_nn_linear(bias):
    torch.manual_seed(1)
    lin = nn.Linear(48, 40, bias=bias)
    mod = SmallGemmLinear(lin)
    assert mod.weight is lin.weight and mod.bias is lin.bias and set(mod.state_dict()) == set(lin.state_dict())
    for shape in ((48,), (1, 48), (2, 3, 48), (1, 5, 48), (MAX_ROWS, 48)):
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(mod(x), lin(x), rtol=1e-5, atol=1e-6)
            assert mod(x).shape == lin(x).shape
    with torch.no_grad():
        x = torch.randn(9, 48)
        assert torch.equal(mod(x), torch.cat([mod(x[i : i + 1]) for i in range(9)]))  # bias added per row too
        big = torch.randn(MAX_ROWS + 1, 48)  # a prefill: PyTorch's own kernel, exactly
        assert torch.equal(mod(big), lin(big))
    # training (autograd) and autocast are F.linear's: the kernel has neither, so they never reach it
    x = torch.randn(3, 48, requires_grad=True)
    mod(x).sum().backward()
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    lin(x).sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, lin.weight.grad)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert mod(torch.randn(2, 48)).dtype == lin(torch.randn(2, 48)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp32 or fp16 CPU weight"):
        SmallGemmLinear(nn.Linear(4, 4).bfloat16())


@needs_kernel
def test_swap_covers_every_fp32_gemm_and_keeps_the_model(ckpt_dir):
    tokens = torch.tensor([[1, 5, 9, 33, 2, 7, 120, 44]])
    model = load_model(ckpt_dir, torch.float32)
    names = set(model.state_dict())
    ref = model(tokens)
    want = fused_gemm_count(model)  # q,k,v,gate,up run fused
    assert small_gemm_linears(model) == want
    a = model.layers[0].self_attn
    assert isinstance(a.qkv, SmallGemmFused) and isinstance(a.o_proj, SmallGemmLinear)
    assert set(model.state_dict()) == names
    torch.testing.assert_close(model(tokens), ref, rtol=1e-4, atol=1e-5)
    # a verify-sized block (8 rows) goes through the kernel: every projection row equals its one-row result
    x = torch.randn(1, 8, model.config.hidden_size)
    for proj in (a.qkv, a.o_proj, model.layers[0].mlp.gate_up, model.lm_head):
        assert torch.equal(proj(x), torch.cat([proj(x[:, i : i + 1]) for i in range(8)], 1))


@needs_kernel
def test_engine_uses_the_kernel_for_fp32_on_the_cpu(ckpt_dir, draft_dir):
    eng = Engine.from_pretrained(ckpt_dir, draft_dir, speculation=SpeculationConfig(k=4, k_policy="constant"))
    assert eng.info["cpu_linear_kernel"] == "small-gemm-fp32" and eng.info["cpu_packed_linears"] > 0
    assert eng.info["attention"] == "sdpa_attention" and eng.stats()["memory"]["cpu_packed_bytes"] == 0
    off = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=False))
    assert off.info["cpu_linear_kernel"] is None and off.info["cpu_packed_linears"] == 0
    required = Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=True))
    assert required.info["cpu_linear_kernel"] == "small-gemm-fp32"
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 9, 10, 11, 9]]
    params = SamplingParams(max_new_tokens=24)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in off.generate(prompts, params)]
    assert eng.stats()["drafted"] > 0


def test_an_amx_build_failure_leaves_the_avx512_kernels(monkeypatch, caplog):
    """Only the AMX code failing to compile (an old assembler) rebuilds without it, and says so."""
    import engine.kernels.cpu_gemm as cg

    built = []

    def fake_load(name, cflags):
        built.append((name, cflags))
        ok = "-DSPECMIX_NO_AMX" in cflags
        return (object(), None) if ok else (None, "error: no such instruction: tdpbf16ps")

    monkeypatch.setattr(cg, "_unsupported_reason", lambda: None)
    monkeypatch.setattr(cg, "cpu_isa", lambda: "AVX512")
    monkeypatch.setattr(cg, "_load", fake_load)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu_gemm"):
        mod, reason, amx = cg._build.__wrapped__()
    assert (
        mod is not None
        and reason is None
        and amx == "the AMX code did not build: error: no such instruction: tdpbf16ps"
    )
    assert built == [
        ("specmix_small_gemm", ["-mavx512f"]),
        ("specmix_small_gemm_noamx", ["-mavx512f", "-DSPECMIX_NO_AMX"]),
    ]
    assert "the AMX kernel did not build" in caplog.text


def test_each_instruction_set_gets_its_own_build(monkeypatch):
    """An AVX2 CPU builds the AVX2 binary (no AMX: it says why); a CPU with neither is refused by name."""
    import engine.kernels.cpu_gemm as cg

    built = []
    monkeypatch.setattr(cg, "_load", lambda name, cflags: (built.append((name, cflags)), (object(), None))[1])
    monkeypatch.setattr(cg, "cpu_isa", lambda: "AVX2")
    monkeypatch.setattr(cg, "_unsupported_reason", lambda: None)
    mod, reason, amx = cg._build.__wrapped__()
    assert mod is not None and reason is None and "AVX2" in amx
    assert built == [("specmix_small_gemm_avx2", ["-mavx2", "-mfma", "-mf16c", "-DSPECMIX_NO_AMX"])]
    monkeypatch.undo()
    monkeypatch.setattr(cg, "cpu_isa", lambda: "DEFAULT")
    monkeypatch.setattr(cg.platform, "machine", lambda: "x86_64")
    assert cg._unsupported_reason() == "needs AVX-512 or AVX2 (PyTorch reports CPU capability DEFAULT)"


def test_a_missing_kernel_is_said_and_refused_when_required(ckpt_dir, monkeypatch, caplog):
    import engine.kernels.cpu_gemm as cg

    why = "needs a C++ compiler ('c++' not found)"
    monkeypatch.setattr(cg, "_build", lambda: (None, why, why))
    with caplog.at_level(logging.INFO, logger="engine.kernels.cpu_linear"):
        eng = Engine.from_pretrained(ckpt_dir)
    assert eng.info["cpu_linear_kernel"] is None and eng.info["cpu_packed_linears"] == 0
    assert "not found" in caplog.text
    with pytest.raises(InvalidConfigError, match=r"cpu_pack=True is invalid here: needs a C\+\+ compiler"):
        Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=True))
    with pytest.raises(KernelUnavailableError, match="unavailable: needs a C"):
        small_gemm_kernel()


def test_no_fast_kernel_for_float16_or_off_the_cpu(ckpt_dir):
    with pytest.raises(
        InvalidConfigError,
        match="cpu_pack=True is invalid here: no fast CPU kernel for dtype "
        "float16.*allowed: device 'cpu' with dtype bfloat16",
    ):
        Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=True), dtype="float16")
    model = load_model(ckpt_dir, torch.float32)
    assert fast_cpu_linears(model, torch.device("cpu"), False) == (0, None)
    assert fast_cpu_linears(model, torch.device("meta"), None) == (0, None)
    with pytest.raises(InvalidConfigError, match="device is 'meta'"):
        fast_cpu_linears(model, torch.device("meta"), True)
    for bad in (0, "false", 1):
        with pytest.raises(
            InvalidConfigError,
            match=r"cpu_pack=.* is invalid: allowed None \(where it runs\), True, "
            "False",
        ):
            Engine.from_pretrained(ckpt_dir, kernels=KernelOptions(cpu_pack=bad))


@needs_kernel
def test_a_stored_fp16_linear_on_the_kernel_is_the_stored_linear():
    """A CPU plan's fp16 StoredLinear on the small-GEMM kernel: its fp16 weight shared, not widened into a copy; the
    StoredLinear's output (the fp16 weight widened exactly) up to and past MAX_ROWS; the storage kept under
    ``.to(dtype)``, while a wrapped fp32 nn.Linear still follows the cast."""
    from engine.core.stored_linear import StoredLinear

    g = torch.Generator().manual_seed(5)
    stored = StoredLinear.from_linear(nn.Linear(72, 40), torch.float16)
    mod = SmallGemmLinear(stored)
    assert mod.weight is stored.weight and mod.weight.dtype == torch.float16
    with torch.no_grad():
        for rows in (1, 5, MAX_ROWS, MAX_ROWS + 7):
            x = torch.randn(rows, 72, generator=g)
            torch.testing.assert_close(mod(x), stored(x), rtol=1e-5, atol=1e-5)
    mod.to(torch.float64)
    assert mod.weight.dtype == torch.float16
    plain = SmallGemmLinear(nn.Linear(8, 4)).to(torch.float64)
    assert plain.weight.dtype == torch.float64


def test_a_killed_builds_lock_is_cleared_and_a_live_one_kept(tmp_path, monkeypatch, caplog):
    """torch waits forever on the lock a killed build leaves: one older than STALE_LOCK_S is removed, with a warning;
    a younger one (a build in progress elsewhere) stays."""
    import os
    import time

    from engine.kernels.cpu_gemm import STALE_LOCK_S, build_directory, clear_stale_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    d = build_directory("specmix_test_ext")
    assert d.is_dir() and tmp_path in d.parents and d.name == "specmix_test_ext"
    assert not clear_stale_lock(d)  # no lock
    lock = d / "lock"
    lock.touch()
    assert not clear_stale_lock(d) and lock.exists()  # a build in progress
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="engine.kernels.cpu_gemm"):
        assert clear_stale_lock(d)
    assert not lock.exists() and "stale build lock" in caplog.text

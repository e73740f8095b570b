"""The GPU path on the CPU: attention backends, runtime profile checks, CUDA graphs, telemetry and
the load window, the GPU bench. These check the logic (graphs emulated, flash-attn through a
pure-PyTorch reference of its kernel); tests/test_gpu_device.py runs it on a CUDA device (-m gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from util import GPU_GREEDY_TOKENS
from util import GPU_PROMPTS as PROMPTS
from util import reference_attention as math_attention

from engine import Engine, SamplingParams
from engine.api.options import (
    KernelOptions,
    Limits,
    LoadWindowConfig,
    SpeculationConfig,
)
from engine.api.runtime import RuntimeSettings, parse_runtime, runtime_settings
from engine.core.attention import math_attention as engine_math_attention
from engine.core.attention import sdpa_attention
from engine.core.errors import InvalidConfigError, KernelUnavailableError, ProfileError
from engine.core.forward import ForwardCall
from engine.core.model import KVCache
from engine.kernels.backends import (
    FlashAttention,
    HardwareFacts,
    attention_available,
    choose_attention,
    facts_for_gpu,
    select_attention,
)
from engine.kernels.cudagraphs import GraphedForward, batch_bucket, kv_bucket
from engine.runtime.telemetry import GpuReading, LoadGovernor, LoadWindow
from quant.catalog import load_catalog, lookup_gpu

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=GPU_GREEDY_TOKENS, temperature=0.0)


# ------------------------------------------------------------------ references


def ref_flash_with_kvcache(
    q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, causal=False, window_size=(-1, -1)
):
    """flash_attn_with_kvcache's documented semantics in PyTorch: q [B,T,H,D], cache [Bc,S,Hkv,D]."""
    B, T = q.shape[:2]
    rows = torch.arange(B) if cache_batch_idx is None else cache_batch_idx.long()
    k, v = k_cache[rows].transpose(1, 2), v_cache[rows].transpose(1, 2)
    S = k.shape[2]
    L = cache_seqlens.long()[:, None, None]
    qpos = L - T + torch.arange(T)[None, :, None]
    j = torch.arange(S)[None, None, :]
    m = (j < L) & ((j <= qpos) if causal else True)
    if window_size[0] >= 0:
        m = m & (j >= qpos - window_size[0])
    return math_attention(q.transpose(1, 2), k, v, m[:, None]).transpose(1, 2)


def ref_flash_func(q, k, v, causal=False):
    T, S = q.shape[1], k.shape[1]
    m = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else torch.ones(T, S, dtype=torch.bool)
    return math_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), m[None, None]).transpose(1, 2)


REF_FLASH = {"func": ref_flash_func, "with_kvcache": ref_flash_with_kvcache}


@pytest.fixture(scope="module")
def pair(ckpt_dir, draft_dir):
    return ckpt_dir, draft_dir


def _engine(pair, limits: Limits = Limits(max_batch=8), **kw) -> Engine:
    t, d = pair
    return Engine.from_pretrained(
        t, d, speculation=SpeculationConfig(k=3, k_policy="constant"), limits=limits, device="cpu", **kw
    )


def _graphed(pair, buckets) -> Engine:
    return _engine(pair, kernels=KernelOptions(cuda_graphs=True, batch_buckets=buckets, emulate_graphs=True))


def _ids(outs):
    return [o.token_ids for o in outs]


# ------------------------------------------------------------------ 1. attention backends


@pytest.mark.parametrize("T,S,heads", [(1, 9, (4, 4)), (3, 9, (4, 4)), (3, 9, (4, 2)), (5, 5, (4, 2))])
def test_sdpa_lower_right_dense_mask_and_math_agree(T, S, heads):
    g = torch.Generator().manual_seed(T * 10 + S)
    q = torch.randn(2, heads[0], T, 16, generator=g)
    k, v = (torch.randn(2, heads[1], S, 16, generator=g) for _ in range(2))
    dense = torch.ones(T, S, dtype=torch.bool).tril(S - T)[None, None].expand(2, 1, T, S)
    ref = math_attention(q, k, v, dense)
    torch.testing.assert_close(sdpa_attention(q, k, v, dense, False), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sdpa_attention(q, k, v, None, True), ref, rtol=1e-5, atol=1e-5)  # lower-right
    for mask, causal in ((dense, False), (None, True)):  # the engine's math backend
        torch.testing.assert_close(engine_math_attention(q, k, v, mask, causal), ref, rtol=1e-5, atol=1e-5)


def test_flash_adapter_with_reference_kernel_matches_sdpa_in_the_cache():
    """Ragged rows (different offsets, explicit cache rows, padding) through with_cache == the masked path."""
    from engine.core.attention import AttentionContext, position_mask

    g = torch.Generator().manual_seed(3)
    H, Hkv, D, S, T = 4, 2, 16, 32, 4
    kc, vc = (torch.randn(6, Hkv, S, D, generator=g) for _ in range(2))
    q = torch.randn(3, H, T, D, generator=g)
    rows = torch.tensor([4, 1, 2])
    pos = torch.tensor([[5, 6, 7, 8], [11, 12, S - 1, S - 1], [0, 1, 2, 3]])  # row 1: two padding queries
    ctx = AttentionContext(pos, rows, False, 13, position_mask(pos, 13, None))
    out = FlashAttention(REF_FLASH).with_cache(q, kc, vc, ctx, None)
    want = sdpa_attention(q, kc[rows, :, :13], vc[rows, :, :13], ctx.mask, False)
    real = pos < S - 1
    torch.testing.assert_close(out.transpose(1, 2)[real], want.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)
    ctx_long = AttentionContext(pos, rows, False, S - 2, position_mask(pos, S - 2, None))
    assert FlashAttention(REF_FLASH).with_cache(q, kc, vc, ctx_long, None) is None  # would pass the end: masked


def test_flash_adapter_engine_output_equals_sdpa(pair):
    ref = _engine(pair)
    flash = _engine(pair)
    for m in (flash.target, flash.draft_model):
        m.attn_fn = FlashAttention(REF_FLASH)
    assert _ids(flash.generate(PROMPTS, GREEDY)) == _ids(ref.generate(PROMPTS, GREEDY))


def test_uniform_start_block_equals_the_masked_block(pair):
    eng = _engine(pair)
    m = eng.target
    cache = KVCache(m.config, 2, 64, torch.float32, "cpu")
    toks = torch.randint(0, 300, (2, 10))
    m(toks, torch.arange(10).expand(2, 10), cache, 10)
    block = torch.randint(0, 300, (2, 4))
    pos = (10 + torch.arange(4)).expand(2, 4)
    a = m(block, pos, cache, 14)  # dense position mask
    b = m(block, pos, cache, 14, start=10)  # no mask: bottom-right causal
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("installed", [True, False])
def test_attention_choice_for_every_catalog_gpu(installed):
    cat = load_catalog()
    for name in cat["gpus"]:
        entry = lookup_gpu(name, cat)
        f = facts_for_gpu(entry, flash_attn_installed=installed)
        want = "flash-attn-2" if installed and entry["flash_attn_2"] else "sdpa"
        assert choose_attention(f) == want, name
        ok, why = attention_available("flash-attn-2", "cuda", f)
        assert ok == (want == "flash-attn-2"), name
        if not ok:
            assert ("compute capability >= 8.0" in why) if not entry["flash_attn_2"] else ("flash-attn package" in why)
            with pytest.raises(KernelUnavailableError, match="flash-attn-2"):
                select_attention("flash-attn-2", "cuda", f)
        fn = select_attention("auto", "cuda", f)
        assert isinstance(fn, FlashAttention) if want == "flash-attn-2" else fn is sdpa_attention
    cpu = HardwareFacts("cpu", flash_attn_installed=True)
    assert choose_attention(cpu) == "sdpa" and select_attention("auto", "cpu", cpu) is sdpa_attention
    with pytest.raises(KernelUnavailableError, match="unknown attention backend 'xformers'.*allowed: sdpa"):
        select_attention("xformers", "cpu", cpu)


# ------------------------------------------------------------------ 2. profile runtime section


def test_runtime_section_is_validated():
    assert parse_runtime(None) == RuntimeSettings()
    rt = parse_runtime({"cuda_graphs": {}, "load_window": {"memory_threshold": 0.9, "resume_below": 0.5}})
    assert rt.cuda_graphs and rt.batch_buckets == (1, 2, 4, 8, 16, 32) and rt.memory_threshold == 0.9
    for bad, match in [
        ({"cuda_graphs": {"enabled": "yes"}}, "cuda_graphs.enabled='yes'.*true or false"),
        ({"cuda_graphs": {"batch_buckets": [0, 2]}}, "batch_buckets=.*ints in 1..4096"),
        ({"load_window": {"memory_threshold": 1.5}}, "memory_threshold=1.5.*\\(0, 1\\]"),
        ({"load_window": {"memory_threshold": 0.6}}, "resume_below=0.7.*below memory_threshold"),
        ({"graphs": True}, "unknown field.*graphs.*allowed: cuda_graphs, load_window"),
        ([], "runtime=\\[\\] is invalid"),
    ]:
        with pytest.raises(ProfileError, match=match):
            parse_runtime(bad)


def test_cuda_graphs_in_a_profile_fail_at_load_without_them_unless_on_the_cpu():
    rt = parse_runtime({"cuda_graphs": {"enabled": True}}, "p.json: runtime")
    cpu = runtime_settings(rt, torch.device("cpu"), "p.json: runtime")
    assert cpu.cuda_graphs is False  # a CPU engine runs eagerly
    no_graphs = HardwareFacts("cuda", (9, 0), cuda_graphs=False)
    with pytest.raises(KernelUnavailableError, match="p.json: runtime.cuda_graphs: CUDA graphs are unavailable"):
        runtime_settings(rt, torch.device("cuda"), "p.json: runtime", no_graphs)
    ok = runtime_settings(rt, torch.device("cuda"), "p.json: runtime", HardwareFacts("cuda", (9, 0), cuda_graphs=True))
    assert ok.cuda_graphs


def test_from_profile_reads_the_runtime_section(tiny_demo, tmp_path):
    import importlib.util

    tool = importlib.import_module("engine.cli.build_profile")
    path = tmp_path / "h100.json"
    assert tool.main(["--gpu", "h100", "--demo-size", "tiny", "--out", str(path), "--device", "cpu", "--quiet"]) == 0
    prof = json.loads(path.read_text())
    prof["runtime"] = {"cuda_graphs": {"enabled": True, "batch_buckets": [1, 8]}}
    path.write_text(json.dumps(prof))
    eng = Engine.from_profile(path)  # a CPU profile: graphs off, no GPU reader
    st = eng.stats()
    assert st["cuda_graphs"] is None and st["gpu"] is None and st["load_window"] is None
    prof["runtime"] = {"cuda_graphs": {"batch_buckets": "all"}}
    path.write_text(json.dumps(prof))
    with pytest.raises(ProfileError, match="h100.json: runtime.cuda_graphs.batch_buckets='all' is invalid"):
        Engine.from_profile(path)


# ------------------------------------------------------------------ 3. CUDA graphs (emulated on the CPU)


def test_buckets():
    assert [batch_bucket(n, (1, 2, 4, 8)) for n in (1, 3, 8, 9)] == [1, 4, 8, None]
    assert kv_bucket(10, 1024) == 256 and kv_bucket(300, 1024) == 512 and kv_bucket(900, 640) == 640


def test_graphed_forward_refuses_a_cpu_model_unless_emulated(pair):
    eng = _engine(pair)
    with pytest.raises(InvalidConfigError, match="CUDA graphs need the model on a CUDA device"):
        GraphedForward(eng.target, (1, 2))


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=24, temperature=0.8, seed=5)])
def test_emulated_graphs_give_the_eager_output(pair, params):
    ref = _engine(pair)
    eng = _graphed(pair, (1, 2, 4))
    runners = eng.cuda_graphs
    assert eng.loop.target is runners[0] and eng.drafter.model is runners[1]
    plist = [SamplingParams(max_new_tokens=n, temperature=params.temperature, seed=params.seed) for n in (24, 5, 17, 9)]
    assert _ids(eng.generate(PROMPTS, plist)) == _ids(ref.generate(PROMPTS, plist))  # ragged, rows leave early
    st = eng.stats()["cuda_graphs"]
    assert st["captures"] > 0 and st["replays"] > 0 and st["eager_calls"] > 0 and st["emulated"]
    assert st["batch_buckets"] == [1, 2, 4]
    assert any(not k.prefix for k in runners[0]._graphs)  # a row left early: explicit rows were graphed too
    assert f"specmix:cuda_graph_replays_total {st['replays']}" in eng.metrics_text()


def test_batches_outside_the_buckets_run_eagerly(pair):
    eng = _graphed(pair, (1, 2))
    t_runner, d_runner = eng.cuda_graphs
    ref = _engine(pair)
    assert _ids(eng.generate(PROMPTS[:3], GREEDY)) == _ids(ref.generate(PROMPTS[:3], GREEDY))
    cache = eng.loop.cache
    one = torch.zeros(1, 1, dtype=torch.long)
    assert t_runner.key_for(ForwardCall(one.expand(3, 1), one.expand(3, 1), cache, 9)) is None  # 3 > 2
    assert t_runner.key_for(ForwardCall(one.expand(2, 1), one.expand(2, 1), cache, 9)) is not None
    T = t_runner.max_tokens + 1  # k_max + 3
    assert t_runner.key_for(ForwardCall(one.expand(2, T), one.expand(2, T), cache, 9)) is None
    assert t_runner.stats.eager_calls > 0 and t_runner.stats.replays > 0  # batch 3 eager, 2 and 1 graphed


def test_a_new_cache_drops_the_graphs(pair):
    eng = _graphed(pair, (1, 2))
    t_runner, _ = eng.cuda_graphs
    eng.generate(PROMPTS[:1], GREEDY)
    assert t_runner.stats.graphs > 0
    sizes = {eng.loop.cache.max_seq_len}
    eng.scheduler.on_round = lambda: sizes.add(eng.loop.cache.max_seq_len)
    try:
        eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=300, temperature=0.0))  # the cache grows, doubling
    finally:
        eng.scheduler.on_round = None
    assert len(sizes) > 1 and t_runner.stats.resets == len(sizes) - 1  # each growth dropped the graphs


# ------------------------------------------------------------------ 4. load window


def test_load_window_scripted_readings():
    w = LoadWindow(k_max=8, batch_max=32, threshold=0.80, resume=0.70, raise_after=2, k_min=1)
    readings = [0.5, 0.85, 0.9, 0.75, 0.79, 0.65, 0.75, 0.6, 0.6, None, 0.6, 0.6, 0.6, 0.6, 0.99, 0.99, 0.99, 0.99]
    caps = [w.update(r) for r in readings]
    assert caps == [
        (8, 32),
        (4, 16),
        (2, 8),
        (2, 8),
        (2, 8),  # above: halve; in the band: hold
        (2, 8),
        (2, 8),  # one low reading, then the band resets the streak
        (2, 8),
        (4, 16),
        (4, 16),  # two low readings in a row: double; None holds
        (4, 16),
        (8, 32),
        (8, 32),
        (8, 32),  # back to the maximum, and it stays there
        (4, 16),
        (2, 8),
        (1, 4),
        (1, 2),
    ]  # floors: k_min 1, batch 1 next
    assert w.update(0.99) == (1, 1) and w.update(0.99) == (1, 1)
    with pytest.raises(InvalidConfigError, match="resume_below=0.9 is invalid: allowed below memory_threshold"):
        LoadWindow(8, 32, threshold=0.8, resume=0.9)


class FakeReader:
    source = "fake"

    def __init__(self, fractions):
        self.fractions, self.calls = list(fractions), 0

    def read(self) -> GpuReading:
        f = self.fractions[min(self.calls, len(self.fractions) - 1)]
        self.calls += 1
        if f is None:
            raise RuntimeError("NVML read failed: test")
        return GpuReading(int(f * 1000), 1000, 50.0)


def test_governor_reads_at_most_every_interval_and_holds_on_a_failed_read():
    now = [0.0]
    gov = LoadGovernor(FakeReader([0.9, None, 0.9]), LoadWindow(8, 16), interval_s=1.0, clock=lambda: now[0])
    assert gov.poll() == (4, 8)
    now[0] = 0.5
    assert gov.poll() == (4, 8) and gov.reader.calls == 1
    now[0] = 1.5
    assert gov.poll() == (4, 8)  # the read failed: caps held
    now[0] = 3.0
    assert gov.poll() == (2, 4)
    assert gov.snapshot()["last_reading"]["memory_used_fraction"] == 0.9


def test_memory_pressure_lowers_k_and_batch_instead_of_failing(pair):
    ref = _engine(pair)
    eng = _engine(pair, Limits(max_batch=8, load_window=LoadWindowConfig(reader=FakeReader([0.95]))))
    gov = eng.scheduler.governor
    gov.interval_s = 0.0
    seen = []
    eng.scheduler.on_round = lambda: seen.append((eng.scheduler.k_cap, eng.scheduler.running()))
    outs = eng.generate(PROMPTS, GREEDY)
    assert _ids(outs) == _ids(ref.generate(PROMPTS, GREEDY))
    st = eng.stats()["load_window"]
    assert st["k_cap"] == 1 and st["batch_cap"] == 1 and st["throttled"] and st["source"] == "fake"
    assert seen[-1][0] == 1 and max(len(o.stats["per_position_acceptance"]) for o in outs) <= 3
    assert "specmix:load_window_k_cap 1" in eng.metrics_text()
    cpu = _engine(pair, Limits(max_batch=8, load_window=LoadWindowConfig()))
    assert cpu.scheduler.governor is None  # the CPU: no reader, no window


# ------------------------------------------------------------------ 5. tools


def test_gpu_bench_cpu_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gpu_bench.py"), "--device", "cpu", "--small", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "gpu-bench-int8.json").read_text())
    assert [row["batch"] for row in res["rows"]] == [1, 2] and not res["skipped"]
    for row in res["rows"]:
        assert set(row["verify_over_decode"]) == {"1", "2"} and row["decode_graph_ms"] > 0 and "c" in row
    assert "| batch | decode eager ms" in (tmp_path / "gpu-bench-int8.md").read_text()


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(REPO / "tools" / name), "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_gpu_kernels_cpu_smoke(tmp_path):
    """Every kernel the CPU has runs on the small shape; errors against fp64 are those of their formats."""
    r = _tool("gpu_kernels.py", "--small", "--rows", "1,8", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "gpu-kernels.json").read_text())
    assert [row["rows"] for row in res["rows"]] == [1, 8] and res["ceilings"]["copy_tbps"] > 0
    for row in res["rows"]:
        assert row["fp16_err"] < 1e-5  # fp32 on the CPU
        assert 1e-3 < row["int8 w8a16"]["err"] < 2e-2 and 1e-3 < row["fp8 weight-only"]["err"] < 6e-2
    assert "| shape | M | fp16 us" in (tmp_path / "gpu-kernels.md").read_text()


def test_gpu_load_cpu_smoke(tmp_path):
    """A checkpoint written on the spot loads through Engine.from_pretrained and decodes at batch 1 and 2."""
    r = _tool("gpu_load.py", "--shape", "small-target", "--batches", "1,2", "--new-tokens", "8", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "gpu-load.json").read_text())
    (row,) = res["rows"]
    assert row["load_s"] > 0 and row["batch1_tok_s"] > 0 and row["batch2_tok_s"] > 0
    assert res["size_bytes"] > res["round_read_bytes"] > 0


def test_gpu_check_script_parses_and_results_file_is_honest():
    assert subprocess.run(["bash", "-n", str(REPO / "tools" / "gpu_check.sh")]).returncode == 0
    text = (REPO / "profiles" / "gpu-results.md").read_text()
    assert "| H200 | 2026-12-04 |" in text and "not yet re-run on a GPU" in text  # what ran, and what did not

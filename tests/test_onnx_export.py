"""ONNX export of one decode/verify step: checker, onnxruntime parity with specmix over a prefill,
8 decode steps and a verify step (fp32 and quantized), refusals, and tools/export_onnx.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from engine.api.options import PrecisionConfig  # noqa: E402
from engine.core.checkpoint import load_model  # noqa: E402
from engine.core.errors import InvalidConfigError, UnsupportedArchitectureError  # noqa: E402
from engine.export.onnx_export import (  # noqa: E402
    OnnxStep,
    build_model,
    check_exportable,
    decode_parity,
    export_step,
    module_parity,
)

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "export_onnx.py"
BUILD = REPO / "tools" / "build_profile.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
FP32_REL = 1e-4  # measured ~1e-6; the issue asks for <= 1e-3


def _prompt(vocab: int, batch: int = 2, n: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _ops(path: Path) -> dict[str, int]:
    m = onnx.load(str(path))
    out: dict[str, int] = {}
    for n in m.graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


def _init_types(path: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in onnx.load(str(path)).graph.initializer:
        out[t.data_type] = out.get(t.data_type, 0) + 1
    return out


# ---------------------------------------------------------------- fp32 exports (random checkpoints)


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("llama", dict(num_hidden_layers=2)),  # GQA 4/2, untied
        ("qwen2", dict(num_hidden_layers=2, tie_word_embeddings=True)),  # q/k/v bias, tied
        ("mistral", dict(num_hidden_layers=2, sliding_window=4)),  # window < prompt
    ],
)
def test_fp32_export_matches_specmix(tmp_path: Path, arch: str, kw: dict) -> None:
    from util import make_checkpoint

    model = load_model(make_checkpoint(tmp_path / arch, arch, **kw))
    path = tmp_path / "step.onnx"
    info = export_step(model, path)  # runs onnx.checker.check_model(full_check=True)
    onnx.checker.check_model(str(path), full_check=True)
    assert info["opset"] >= 21 and info["quantization"] == {}
    assert info["inputs"]["past_key_values.1.value"]["shape"] == ["batch", 2, "past_seq", 16]
    assert info["outputs"]["present.0.key"]["shape"] == ["batch", 2, "total_seq", 16]
    p = decode_parity(model, OnnxStep(path), _prompt(300), steps=8, verify=3)
    assert p.max_rel <= FP32_REL, p
    assert p.argmax_agree == 1.0 and p.logit_scale > 0.5
    if arch == "mistral":  # the window is in the graph: the same weights without it do not match
        model.config.sliding_window = None
        export_step(model, tmp_path / "nowin.onnx")
        model.config.sliding_window = 4
        q = decode_parity(model, OnnxStep(tmp_path / "nowin.onnx"), _prompt(300), steps=8, verify=3)
        assert q.max_rel > 100 * FP32_REL, q


def test_cache_is_explicit_and_batch_step_axes_are_dynamic(tmp_path: Path, ckpt_dir: Path) -> None:
    """One graph serves batch 1 and 3, prefill and multi-token steps; present = past ++ new."""
    model = load_model(ckpt_dir)
    path = tmp_path / "t.onnx"
    export_step(model, path)
    step = OnnxStep(path)
    for batch in (1, 3):
        ids = _prompt(300, batch, 5)
        logits, cache = step(ids.numpy(), torch.arange(5).expand(batch, 5).numpy(), step.empty_cache(batch))
        assert logits.shape == (batch, 5, 300) and len(cache) == 2 * 4
        assert all(c.shape == (batch, 2, 5, 16) for c in cache)
        nxt = ids[:, :3]
        logits2, cache2 = step(nxt.numpy(), (5 + torch.arange(3)).expand(batch, 3).numpy(), cache)
        assert logits2.shape == (batch, 3, 300) and all(c.shape == (batch, 2, 8, 16) for c in cache2)
        assert all((c2[:, :, :5] == c).all() for c, c2 in zip(cache, cache2))
        with torch.no_grad():  # the same 8 tokens in one causal pass
            full = model(torch.cat([ids, nxt], 1))
        assert (torch.from_numpy(logits2) - full[:, 5:]).abs().max() <= FP32_REL * full.abs().max()


def test_tiny_demo_fp32_target_and_draft(tmp_path: Path, tiny_demo) -> None:
    for role, d in zip(("target", "draft"), tiny_demo):
        model = load_model(d)
        path = tmp_path / f"{role}.onnx"
        export_step(model, path)
        p = decode_parity(model, OnnxStep(path), _prompt(model.config.vocab_size, n=10), steps=8, verify=4)
        assert p.max_rel <= FP32_REL, (role, p)


# ---------------------------------------------------------------- quantized exports (the tiny demo pair)


@pytest.fixture(scope="module")
def planned(tiny_demo) -> dict:
    """The tiny pair quantized by the a100 plan (INT8 w8a8 FFN + SmoothQuant, FP8 weight-only draft)
    and by the h100 plan (FP8 native draft: per-token e4m3 activations)."""
    from engine import Engine
    from engine.core.config import load_config
    from quant.catalog import lookup_gpu
    from quant.plan import make_plan

    t_dir, d_dir = tiny_demo
    calib = (t_dir.parent / "calib.txt").read_text(encoding="utf-8")
    out = {"ref": {"target": load_model(t_dir), "draft": load_model(d_dir)}}
    for gpu in ("a100", "h100"):
        plan = make_plan(lookup_gpu(gpu), load_config(t_dir), load_config(d_dir), device="cpu")
        eng = Engine.from_pretrained(t_dir, d_dir, precision=PrecisionConfig(plan, calib), device="cpu")
        out[gpu] = {"target": eng.target, "draft": eng.draft_model, "tok": eng.tokenizer}
    return out


def _text_prompt(tok, vocab: int) -> torch.Tensor:
    rows = [
        tok.encode("def fibonacci(n):\n    if n < 2:\n        return n"),
        tok.encode("The with statement is used to wrap the execution of a block"),
    ]
    n = min(len(r) for r in rows)
    return torch.tensor([[t % vocab for t in r[:n]] for r in rows])


@pytest.mark.parametrize("gpu,role", [("a100", "target"), ("a100", "draft"), ("h100", "draft")])
def test_quantized_export_matches_specmix_quantized(tmp_path: Path, planned: dict, gpu: str, role: str) -> None:
    from onnx import TensorProto

    model, ref = planned[gpu][role], planned["ref"][role]
    path = tmp_path / f"{gpu}-{role}.onnx"
    info = export_step(model, path)
    ops, types = _ops(path), _init_types(path)
    L = model.config.num_hidden_layers
    if role == "target":  # INT8 FFN: int8 weights -> DQ, per-token dynamic Q/DQ of the activations
        assert info["quantization"]["int8 w8a8"] == [f"layers.*.mlp.{n}" for n in ("down_proj", "gate_proj", "up_proj")]
        assert "int8 SmoothQuant" in info["quantization"]
        assert types.get(TensorProto.INT8) == 3 * L and TensorProto.FLOAT8E4M3FN not in types
        assert ops["QuantizeLinear"] == 3 * L and ops["DequantizeLinear"] == 6 * L
    else:  # FP8 draft: e4m3 initializers (tied table shared with the head) -> DQ
        assert types.get(TensorProto.FLOAT8E4M3FN) == 7 * L + 1 and TensorProto.INT8 not in types
        assert ops["DequantizeLinear"] == (7 * L + 1) * (2 if gpu == "h100" else 1)
        assert ops.get("QuantizeLinear", 0) == (7 * L + 1 if gpu == "h100" else 0)
    prompt = _text_prompt(planned[gpu]["tok"], model.config.vocab_size)
    p = decode_parity(model, OnnxStep(path), prompt, steps=8, reference=ref, verify=4)
    assert p.ref_max_abs is not None and p.ref_mean_abs is not None
    assert p.ref_max_abs > 1e-3  # the plan really quantized: a dropped Q/DQ would show up below
    assert p.max_abs <= 0.1 * p.ref_max_abs and p.mean_abs <= 0.02 * p.ref_mean_abs, p
    assert p.passed()
    m = module_parity(model, prompt)
    assert m["modules"] == (3 * L if role == "target" else 7 * L + 1)
    assert m["max_rel"] <= 1e-5 and m["quantized_activations_differing"] == 0, m
    assert (m["quantized_activations"] > 0) == (role == "target" or gpu == "h100")


def test_dropping_the_activation_quantization_is_caught(tmp_path: Path, planned: dict) -> None:
    """Negative control: the W8A8 target with its activations left in float (weight-only Q/DQ) is
    measurably off specmix's quantized logits, so the parity bound above can fail."""
    model = planned["a100"]["target"]
    proto, _ = build_model(model)
    made_by = {o: n for n in proto.graph.node for o in n.output}
    n_changed = 0
    for n in proto.graph.node:  # Gemm(DQ(Q(x)), DQ(W)) -> Gemm(x, DQ(W)): weight-only Q/DQ
        dq = made_by.get(n.input[0])
        if n.op_type == "Gemm" and dq is not None and dq.op_type == "DequantizeLinear":
            n.input[0] = made_by[dq.input[0]].input[0]
            n_changed += 1
    assert n_changed == 3 * model.config.num_hidden_layers
    path = tmp_path / "weight_only.onnx"
    onnx.save(proto, str(path))
    p = decode_parity(
        model, OnnxStep(path), _text_prompt(planned["a100"]["tok"], 512), steps=8, reference=planned["ref"]["target"]
    )
    assert p.mean_abs > 0.02 * p.ref_mean_abs, p


@pytest.mark.parametrize("group", [None, 32, 64])
def test_weight_only_int8_exports_per_channel_and_per_group(group) -> None:
    """W8A16: DequantizeLinear of the int8 weight (per row, or per group along the inputs) in a Gemm, float
    activations; onnxruntime's output equals the module's within float32 rounding."""
    from engine.export.onnx_export import OnnxStep
    from engine.export.onnx_graph import build_linear_graph
    from quant.linear import Int8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 40, bias=True)
    mod = Int8Linear.from_float(lin, kernel="w8a16", group_size=group)
    x = torch.randn(5, 192)
    with torch.no_grad():
        want = mod(x)
    proto = build_linear_graph(mod, "lin")
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == 0 and ops.count("DequantizeLinear") == 1 and len(proto.graph.output) == 1
    got = OnnxStep(proto, kind="linear").session.run(None, {"x": x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-4)


def test_refusals(planned: dict) -> None:
    from engine.core.config import ModelConfig
    from engine.core.model import Transformer

    model = planned["a100"]["target"]
    down = model.layers[0].mlp.down_proj
    down.set_kernel("llm-int8")
    try:
        with pytest.raises(InvalidConfigError, match=r"layers\.0\.mlp\.down_proj: int8 kernel='llm-int8'"):
            build_model(model)
    finally:
        down.set_kernel("w8a8")
    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=16,
        hidden_size=12,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=3,
        max_position_embeddings=8,
    )
    with torch.device("meta"):
        odd = Transformer(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="head_dim=3"):
        check_exportable(odd)


# ---------------------------------------------------------------- tools/export_onnx.py


@pytest.fixture(scope="module")
def tool():
    return importlib.import_module("engine.cli.export_onnx")


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory: pytest.TempPathFactory, tiny_demo) -> Path:
    """profiles/a100-80gb-demo.json of a scratch checkout: build_profile.py on the tiny demo pair."""
    root = tmp_path_factory.mktemp("checkout")
    out = root / "profiles" / "a100-80gb-demo.json"
    r = subprocess.run(
        [
            sys.executable,
            str(BUILD),
            "--gpu",
            "a100",
            "--demo-size",
            "tiny",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return out


def test_cli_default_profile_writes_graphs_and_manifest(tool, tiny_profile: Path, monkeypatch, capsys) -> None:
    root = tiny_profile.parent.parent
    monkeypatch.chdir(root)  # the defaults (profiles/..., build/onnx/...) are relative to the working directory
    rc = tool.main(["--quiet"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = root / "build" / "onnx" / "a100-80gb-demo"
    assert sorted(p.name for p in out.iterdir()) == ["draft.onnx", "manifest.json", "target.onnx"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["opset"] >= 21 and m["parity_check"]["passed"] is True
    assert set(m["graphs"]) == {"target", "draft"} and "input_ids" in m["graphs"]["target"]["inputs"]
    planned = json.loads(tiny_profile.read_text())["plan"]["target"]["modules"]  # the kernels the build measured best
    kernels = {f"int8 {p['kernel']}" for n, p in planned.items() if ".mlp." in n and p["storage"] == "int8"}
    assert kernels and kernels <= set(m["graphs"]["target"]["quantization"])
    assert "fp8 weight-only" in m["graphs"]["draft"]["quantization"]
    for role in ("target", "draft"):
        onnx.checker.check_model(str(out / f"{role}.onnx"), full_check=True)
        p = m["parity"][role]
        assert p["max_abs"] <= p["ref_max_abs"] and p["modules"]["quantized_activations_differing"] == 0
    assert "target: target.onnx" in cap.out


def test_cli_missing_default_profile_exit_2(tool, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert tool.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a100-80gb-demo.json is missing" in err and "build_profile" in err
    assert not (tmp_path / "build").exists()


def test_cli_bad_input_one_line_exit_2_subprocess(tmp_path: Path) -> None:
    for args in (["--profile", str(tmp_path / "nope.json")], ["--steps", "-1"]):
        r = subprocess.run(
            [sys.executable, str(TOOL), *args, "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            env=ENV,
            cwd=REPO,
            timeout=300,
        )
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.startswith("export_onnx: ")
    assert not (tmp_path / "o").exists()

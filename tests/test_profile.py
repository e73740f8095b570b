"""tools/build_profile.py and Engine.from_profile on the tiny demo pair."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.core.errors import KernelUnavailableError, ProfileError
from engine.spec_decode.adaptive import Costs
from quant.plan_io import plan_from_dict

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "tools" / "build_profile.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("build_profile_tool", BUILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def builds(tool, tiny_demo, tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    out = {}
    for gpu in ("a100", "h100"):
        path = d / f"{gpu}.json"
        rc = tool.main(["--gpu", gpu, "--demo-size", "tiny", "--out", str(path), "--device", "cpu", "--quiet"])
        assert rc == 0
        out[gpu] = path
    return out


def test_demo_builds_pass_the_gate_and_plans_follow_the_catalog(builds, tiny_demo):
    a100, h100 = (json.loads(builds[g].read_text()) for g in ("a100", "h100"))
    for p in (a100, h100):
        q = p["quality"]
        assert abs(q["drift"]) <= 0.3 and q["kld_mean"] <= 0.01 and q["attempts"][-1]["passed"]
        assert p["precision"] == {
            "draft_model": "fp8",
            "main_model": {"attention": "fp16", "ffn": "int8"},
            "verifier": "fp16",
        }
        assert p["plan"]["target"]["families"]["lm_head"]["storage"] in ("fp32", "fp16")
        assert p["models"]["target"]["path"] == f"demo:{tiny_demo[0].parent.name}/target"  # demo-tiny-v<N>-<digest>
        s = p["speculation"]
        assert s["k_min"] <= s["k"] <= s["k_max"] and 0 <= s["acceptance"] <= 1
        for key in ("drafter", "policy", "acceptance_fp16_draft", "c", "v", "predicted_speedup"):
            assert key in s
        assert p["memory"]["target"]["bytes"] < p["memory"]["target"]["fp16_bytes"]
        assert p["memory"]["draft"]["bytes"] < p["memory"]["draft"]["fp16_bytes"]
    # A100 has no FP8 tensor cores (weight-only FP8 draft); H100 runs FP8 natively
    assert a100["plan"]["draft"]["families"]["ffn"]["kernel"] == "weight-only"
    assert h100["plan"]["draft"]["families"]["ffn"]["kernel"] == "native"
    assert a100["gpu"]["name"] == "a100-80gb" and h100["gpu"]["name"] == "h100-sxm"


def test_builds_write_the_report_beside_the_profile(builds):
    for path in builds.values():
        md = path.with_suffix(".md").read_text(encoding="utf-8")
        assert md.startswith(f"# Build report: {path.stem}")
        assert path.with_suffix(".png").is_file() == ("Plot skipped" not in md)


def test_failed_gate_writes_nothing_and_keeps_the_old_profile(tool, builds, tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_bytes(builds["a100"].read_bytes())
    before = path.read_bytes()
    rc = tool.main(
        [
            "--gpu",
            "a100",
            "--demo-size",
            "tiny",
            "--out",
            str(path),
            "--device",
            "cpu",
            "--quiet",
            "--max-drift",
            "1e-9",
            "--no-fallback",
        ]
    )
    assert rc == 1
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temp file left behind
    assert "no plan passed the gate" in capsys.readouterr().err


def test_round_trip_same_plan_and_same_greedy_outputs(builds, tiny_demo):

    prof = json.loads(builds["a100"].read_text())
    eng = Engine.from_profile(builds["a100"])
    plan = plan_from_dict(prof["plan"])
    assert plan.to_dict() == prof["plan"]
    calib = (tiny_demo[0].parent / "calib.txt").read_text(encoding="utf-8")
    s = prof["speculation"]
    validated = Engine.from_pretrained(
        *tiny_demo,
        speculation=SpeculationConfig(
            k=s["k"],
            k_policy=s["policy"],
            k_min=s["k_min"],
            k_max=s["k_max"],
            costs=Costs.from_dict({"c": s["c"], "v": s["v"]}),
        ),
        precision=PrecisionConfig(plan, calib),
    )
    prompts = ["The with statement", "A class definition", "import sys\n"]
    sp = SamplingParams(max_new_tokens=32)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in validated.generate(prompts, sp)]
    assert type(eng.target.layers[0].mlp.up_proj).__name__ == "Int8Linear"
    assert type(eng.draft_model.layers[0].mlp.up_proj).__name__ == "FP8Linear"


def _edited(builds, tmp_path, edit) -> Path:
    prof = json.loads(builds["a100"].read_text())
    edit(prof)
    p = tmp_path / "edited.json"
    p.write_text(json.dumps(prof))
    return p


def test_refuses_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="nope.json: profile file is missing"):
        Engine.from_profile(tmp_path / "nope.json")


def test_refuses_invalid_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{oops")
    with pytest.raises(ProfileError, match="bad.json: invalid JSON"):
        Engine.from_profile(p)


def test_refuses_unknown_schema_version(builds, tmp_path):
    p = _edited(builds, tmp_path, lambda d: d.update(schema_version=99))
    with pytest.raises(ProfileError, match="schema_version=99 is not supported"):
        Engine.from_profile(p)


@pytest.mark.parametrize("field", ["plan", "speculation", "models"])
def test_refuses_missing_fields(builds, tmp_path, field):
    p = _edited(builds, tmp_path, lambda d: d.pop(field))
    with pytest.raises(ProfileError, match=f"missing field.*{field}"):
        Engine.from_profile(p)


def test_refuses_changed_weights(builds, tmp_path):
    def edit(d):
        d["models"]["draft"]["sha256"]["model.safetensors"] = "0" * 64

    p = _edited(builds, tmp_path, edit)
    with pytest.raises(ProfileError, match="models.draft.sha256.*no longer matches"):
        Engine.from_profile(p)


def test_refuses_a_kernel_the_machine_lacks(builds, tmp_path):
    def te(d):
        for fam in ("attention", "ffn", "lm_head"):
            d["plan"]["draft"]["families"][fam]["kernel"] = "te"

    with pytest.raises(KernelUnavailableError, match="'te'.*transformer"):
        Engine.from_profile(_edited(builds, tmp_path, te))

    def flash(d):
        d["plan"]["attention_backend"] = "flash-attn-2"

    with pytest.raises(KernelUnavailableError, match="flash-attn-2.*CUDA"):
        Engine.from_profile(_edited(builds, tmp_path, flash))


def test_refuses_a_cuda_profile_without_cuda(builds, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    p = _edited(builds, tmp_path, lambda d: d.update(device="cuda"))
    with pytest.raises(ProfileError, match="no CUDA device"):
        Engine.from_profile(p)


@pytest.mark.parametrize(
    "args,match",
    [
        (["--gpu", "b300"], "b300.*a100"),
        (["--gpu", "a100", "--demo-size", "tiny", "--eval-text", "/nonexistent/x.txt"], "eval-text"),
        (
            ["--gpu", "a100", "--target", "/nonexistent/t", "--eval-text", str(REPO / "README.md")],
            "/nonexistent/t: model directory does not exist",
        ),
        (["--gpu", "a100", "--draft", "/nonexistent/d"], "--draft needs --target"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args, match, tiny_demo):
    r = subprocess.run(
        [sys.executable, str(BUILD), *args, "--quiet"], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr
    import re

    assert re.search(match, lines[0])

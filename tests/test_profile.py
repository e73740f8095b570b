"""tools/build_profile.py and Engine.from_profile on the tiny demo pair."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import Engine, SamplingParams
from engine.api.options import PrecisionConfig, SpeculationConfig
from engine.api.profile import Profile, engine_options, load_profile
from engine.core.errors import KernelUnavailableError, ProfileError
from engine.kernels.cpu_gemm import small_gemm_status
from engine.spec_decode.adaptive import Costs
from quant.linear import FP8Linear
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
def build_run(tool, tiny_demo, tmp_path_factory):
    """Two builds: {"paths": {gpu: the profile file}, "made": {file: the Profile the build wrote to it}}."""
    d = tmp_path_factory.mktemp("profiles")
    cli = importlib.import_module("engine.cli.build_profile")
    out, made = {}, {}
    write = cli.write_profile

    def recording(profile, path):
        made[path] = profile
        return write(profile, path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "write_profile", recording)
        for gpu in ("a100", "h100"):
            path = d / f"{gpu}.json"
            rc = tool.main(["--gpu", gpu, "--demo-size", "tiny", "--out", str(path), "--device", "cpu", "--quiet"])
            assert rc == 0
            out[gpu] = path
    return {"paths": out, "made": made}


@pytest.fixture(scope="module")
def builds(build_run):
    return build_run["paths"]


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
    assert isinstance(eng.profile, Profile) and eng.profile.path == builds["a100"]
    assert eng.profile.to_dict() == prof
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
    if small_gemm_status() is None:  # the FP8 draft runs on the C++ step: no dequantized fp32 copy is ever made
        assert eng.info["cpu_decode_step"] == ["target", "draft"] and eng.info["draft_step_weights"] == "float16"
        fp8 = [m for m in eng.draft_model.modules() if isinstance(m, FP8Linear)]
        assert fp8 and not any(m.kernel_state for m in fp8)
    alone = PrecisionConfig(dataclasses.replace(plan, draft=None), calib)  # the planned target, no speculation
    plain = Engine.from_pretrained(tiny_demo[0], precision=alone)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain.generate(prompts, sp)]


def test_the_profile_written_is_the_profile_read(build_run):
    """One class writes and reads a profile: the built object round-trips, and the file is its to_dict()."""
    assert len(build_run["made"]) == 2
    for path, made in build_run["made"].items():
        assert isinstance(made, Profile) and made.path is None
        assert Profile.from_dict(made.to_dict(), "made") == made
        assert Profile.from_dict(json.loads(json.dumps(made.to_dict())), "made") == made
        loaded = load_profile(path)
        assert loaded == made and loaded.path == path
        on_disk = json.loads(path.read_text())
        assert loaded.to_dict() == on_disk and list(loaded.to_dict()) == list(on_disk)
        assert json.dumps(loaded.to_dict(), indent=2) + "\n" == path.read_text()  # the same bytes
        assert "_path" not in on_disk and "path" not in on_disk


def test_the_sections_are_typed(builds, tiny_demo):
    prof = load_profile(builds["a100"])
    t = prof.throughput  # the planned models decoded beside the unquantized ones on the build's device
    assert t is not None and t.rounds == 3 and t.prompts >= 1 and t.max_new_tokens >= 1
    assert all(r.tokens_per_s > 0 and r.weight_bytes > 0 for r in (t.unquantized_plain, t.planned_speculative))
    assert t.planned_plain.weight_bytes < t.unquantized_plain.weight_bytes  # the INT8 FFN, no dense copy kept
    assert t.planned_speculative.weight_bytes < t.unquantized_speculative.weight_bytes  # and the FP8 draft
    assert "## Throughput" in builds["a100"].with_suffix(".md").read_text(encoding="utf-8")
    s = prof.speculation
    assert s.config.drafter == "model" and s.config.k_policy == "measured" and s.config.costs is not None
    assert s.config.k_min <= s.config.k <= s.config.k_max
    assert s.measured.probe.greedy and 0 <= s.measured.acceptance <= 1 and s.measured.acceptance_fp16_draft is not None
    assert prof.plan.device == prof.device == "cpu" and prof.memory.draft.bytes < prof.memory.draft.fp16_bytes
    assert prof.quality.attempts[-1].passed and prof.quality.attempts[-1].figures == prof.quality.figures
    assert prof.runtime is not None and not prof.runtime.cuda_graphs and prof.runtime.load_window
    opts = engine_options(prof)
    assert opts["speculation"] == s.config and opts["precision"].plan == prof.plan
    assert opts["target"] == tiny_demo[0] and opts["draft"] == tiny_demo[1]


def test_old_profiles_load():
    """A schema 1 profile written before the Profile class (the tiny demo pair, by the old dict writer) reads, and
    writes back byte for byte."""
    path = REPO / "tests" / "data" / "profile-schema1-tiny.json"
    prof = load_profile(path, check_weights=False)
    assert prof.to_dict() == json.loads(path.read_text())
    assert json.dumps(prof.to_dict(), indent=2) + "\n" == path.read_text()


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


def test_refuses_schema_version_2_naming_it(builds, tmp_path):
    p = _edited(builds, tmp_path, lambda d: d.update(schema_version=2))
    with pytest.raises(ProfileError, match=r"edited.json: schema_version=2 is not supported: allowed 1"):
        load_profile(p)
    with pytest.raises(ProfileError, match=r"^here: schema_version=2 is not supported"):
        Profile.from_dict(json.loads(p.read_text()), "here")


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d["speculation"].update(k="5"), r"field speculation.k='5' is invalid: allowed an int"),
        (lambda d: d.update(memory=[]), r"field memory=\[\] is invalid: allowed a JSON object"),
        (lambda d: d["memory"]["target"].update(bytes=1.5), r"field memory.target.bytes=1.5 is invalid"),
        (lambda d: d["quality"]["gates"].update(max_kld="low"), r"field quality.gates.max_kld='low' is invalid"),
        (lambda d: d["quality"]["attempts"][0].update(passed="yes"), r"field quality.attempts\[0\].passed='yes'"),
        (lambda d: d["speculation"]["probe"].update(greedy=1), r"field speculation.probe.greedy=1 is invalid"),
        (lambda d: d["models"]["draft"].update(sha256=["x"]), r"field models.draft.sha256=\['x'\] is invalid"),
        (lambda d: d.update(device="tpu"), r"field device='tpu' is invalid: allowed cuda, cpu"),
        (lambda d: d["calibration"].update(text=None), r"field calibration.text=None is invalid"),
        (lambda d: d["quality"].pop("gates"), r"field quality.gates is missing"),
        (lambda d: d["speculation"].update(k_min=99), r"speculation: speculation.k_min=99 is above"),
        (
            lambda d: d["throughput"]["planned_plain"].update(tokens_per_s=0),
            r"field throughput.planned_plain.tokens_per_s=0 is invalid: allowed a positive number",
        ),
        (lambda d: d["throughput"].update(rounds=0), r"field throughput.rounds=0 is invalid: allowed an int >= 1"),
        (lambda d: d["throughput"].pop("unquantized_plain"), r"field throughput.unquantized_plain is missing"),
    ],
)
def test_refuses_a_wrong_typed_field_naming_it(builds, tmp_path, edit, match):
    p = _edited(builds, tmp_path, edit)
    with pytest.raises(ProfileError, match=f"edited.json: {match}"):
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
        (["--gpu", "a100", "--throughput-rounds", "-1"], "--throughput-rounds=-1 is invalid: allowed an int in 0..100"),
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


def test_a_profile_served_without_its_drafter_keeps_its_plan(builds):
    """`specmix-serve --profile P --no-spec`: the profile's quantized target, no drafter: the baseline a
    profile's speculation is benchmarked against (greedy tokens equal the speculative engine's)."""
    from engine import SamplingParams
    from engine.cli.serve import build_parser, load

    spec, _, _ = load(build_parser().parse_args(["--profile", str(builds["a100"])]))
    plain, _, _ = load(build_parser().parse_args(["--profile", str(builds["a100"]), "--no-spec"]))
    assert spec.drafter is not None and plain.drafter is None
    mem = "target_weight_bytes"
    assert plain.stats()["memory"][mem] == spec.stats()["memory"][mem]  # the same planned (quantized) target
    sp, prompts = SamplingParams(max_new_tokens=24), [[5, 6, 7], [9, 10, 11, 12]]
    assert [o.token_ids for o in plain.generate(prompts, sp)] == [o.token_ids for o in spec.generate(prompts, sp)]

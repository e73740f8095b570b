"""tools/perplexity.py: reproduces a built profile's gate, fails on bounds and on a changed record, exit 2 on
bad input."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "perplexity.py"
BUILD = REPO / "tools" / "build_profile.py"
WIKI = Path(__file__).resolve().parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _run(*args: str | Path, tool: Path = TOOL, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(tool), *map(str, args)], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=timeout
    )


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("perplexity_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A profile written by tools/build_profile.py for a random target/draft pair on the CPU."""
    from util import TEXT, make_checkpoint

    if not BUILD.is_file():
        pytest.skip("tools/build_profile.py is missing")
    d = tmp_path_factory.mktemp("prof")
    target = make_checkpoint(d / "target", "llama", num_hidden_layers=4)
    draft = make_checkpoint(d / "draft", "llama", num_hidden_layers=4, perturb=0.005)
    (d / "eval.txt").write_text(TEXT * 6, encoding="utf-8")
    (d / "calib.txt").write_text(TEXT[::-1] * 4, encoding="utf-8")
    out = d / "p.json"
    r = _run(
        "--gpu",
        "a100",
        "--target",
        target,
        "--draft",
        draft,
        "--eval-text",
        d / "eval.txt",
        "--calib-text",
        d / "calib.txt",
        "--out",
        out,
        "--device",
        "cpu",
        "--quiet",
        "--max-drift",
        "1e6",
        tool=BUILD,
    )  # the drift of a random model is not what is tested here
    assert r.returncode == 0, r.stderr
    return {"dir": d, "path": out, "profile": json.loads(out.read_text())}


def _main(tool, capsys, *args) -> tuple[int, str, str]:
    rc = tool.main([str(a) for a in args] + ["--quiet"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_reproduces_the_build_figures_subprocess(built: dict) -> None:
    r = _run("--profile", built["path"], "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    got, rec = json.loads(r.stdout), built["profile"]["quality"]
    q = got["quality"]
    assert got["same_eval_text"] and got["checks"] == {"drift": True, "kld": True, "reproduced": True}
    for k in ("ppl_ref", "ppl", "drift", "kld_mean", "kld_p99", "top1"):
        assert q[k] == pytest.approx(rec[k], rel=1e-6, abs=1e-9), k
    assert q["tokens"] == rec["tokens"] and q["windows"] == rec["windows"] and q["context"] == rec["context"]
    assert got["bounds"] == rec["gates"] and got["exit_code"] == 0


def test_text_report_like_llama_cpp(tool, built: dict, capsys) -> None:
    rc, out, _ = _main(tool, capsys, "--profile", built["path"])
    q = built["profile"]["quality"]
    assert rc == 0
    assert f"Final estimate: PPL(base) = {q['ppl_ref']:.4f} +/- {q['ppl_ref_err']:.5f}" in out
    assert f"Final estimate: PPL(Q)    = {q['ppl']:.4f} +/- {q['ppl_err']:.5f}" in out
    lo, hi = q["drift_ci95"]
    assert f"Mean PPL(Q)-PPL(base)     = {q['drift']:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}]" in out
    assert f"Mean    KLD: {q['kld_mean']:10.6f}" in out and f"99.0%   KLD: {q['kld_p99']:10.6f}" in out
    assert f"Same top p: {100 * q['top1']:.3f}" in out
    assert "reproduced (rel tol 0.001)" in out and out.rstrip().endswith("PASS")


def test_bounds_exceeded_exit_1(tool, built: dict, capsys) -> None:
    q = built["profile"]["quality"]
    rc, out, _ = _main(tool, capsys, "--profile", built["path"], "--max-kld", q["kld_mean"] * 0.5, "--json")
    r = json.loads(out)
    assert rc == 1 and r["checks"]["kld"] is False and r["checks"]["drift"] is True and not r["passed"]
    rc, out, _ = _main(tool, capsys, "--profile", built["path"], "--max-drift", abs(q["drift"]) * 0.5)
    assert rc == 1 and "FAIL" in out and f"> {abs(q['drift']) * 0.5:g}" in out
    # gates from the profile itself when no flag is given
    prof = dict(built["profile"], quality={**q, "gates": {"max_drift": 1e6, "max_kld": q["kld_mean"] * 0.5}})
    p = built["dir"] / "tight.json"
    p.write_text(json.dumps(prof))
    rc, out, _ = _main(tool, capsys, "--profile", p, "--json")
    assert rc == 1 and json.loads(out)["bounds"]["max_kld"] == q["kld_mean"] * 0.5


def test_recorded_ppl_not_reproduced_exit_1(tool, built: dict, capsys) -> None:
    q = built["profile"]["quality"]
    prof = dict(built["profile"], quality={**q, "ppl": q["ppl"] * 1.01})
    p = built["dir"] / "tampered.json"
    p.write_text(json.dumps(prof))
    rc, out, _ = _main(tool, capsys, "--profile", p)
    assert rc == 1 and "NOT reproduced" in out and "FAIL" in out
    rc, out, _ = _main(tool, capsys, "--profile", p, "--ppl-rtol", "0.02", "--json")
    assert rc == 0 and json.loads(out)["checks"]["reproduced"] is True
    # a different token cap on the same text is not compared with the record
    rc, out, _ = _main(tool, capsys, "--profile", p, "--max-tokens", "600", "--json")
    r = json.loads(out)
    assert rc == 0 and r["recorded"] is None and r["checks"]["reproduced"] is None and r["quality"]["tokens"] == 599


@pytest.mark.skipif(not WIKI.is_file(), reason=f"WikiText-2 test split not found at {WIKI}")
def test_wikitext2_eval_text(tool, built: dict, capsys) -> None:
    rc, out, _ = _main(
        tool,
        capsys,
        "--profile",
        built["path"],
        "--eval-text",
        WIKI,
        "--max-tokens",
        "20000",
        "--max-drift",
        "1e9",
        "--max-kld",
        "1",
        "--json",
    )
    r = json.loads(out)
    q = r["quality"]
    assert rc == 0 and r["same_eval_text"] is False and r["recorded"] is None
    assert q["tokens"] == 19_999 and q["windows"] == 78 and q["context"] == 512
    assert all(math.isfinite(q[k]) for k in ("ppl_ref", "ppl", "drift", "kld_mean", "kld_p99", "top1"))
    assert q["kld_mean"] > 0 and 0 < q["top1"] <= 1


def test_bad_input_one_line_exit_2_subprocess(tmp_path: Path) -> None:
    for args, want in [
        (("--profile", tmp_path / "none.json"), "none.json: profile file is missing"),
        (("--profile", "x.json", "--max-kld", "-1"), "--max-kld"),
        ((), "--profile"),
    ]:
        r = _run(*args, timeout=120)
        assert r.returncode == 2 and r.stdout == "", (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and want in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("case", ["eval-missing", "bad-json", "no-gates", "no-ppl", "max-tokens", "drift-nan"])
def test_bad_input_exit_2(tool, built: dict, capsys, tmp_path: Path, case: str) -> None:
    q = built["profile"]["quality"]
    p = tmp_path / "p.json"
    args: list = ["--profile", p]
    prof = built["profile"]
    if case == "eval-missing":
        args += ["--eval-text", tmp_path / "gone.txt"]
        want = "gone.txt"
    elif case == "bad-json":
        p.write_text("{not json")
        want = "invalid JSON"
    elif case == "no-gates":
        prof = dict(prof, quality={k: v for k, v in q.items() if k != "gates"})
        want = "field quality.gates is missing"
    elif case == "no-ppl":
        prof = dict(prof, quality={k: v for k, v in q.items() if k != "ppl"})
        want = "quality.ppl"
    elif case == "max-tokens":
        args += ["--max-tokens", "1"]
        want = "--max-tokens"
    else:
        args += ["--max-drift", "nan"]
        want = "--max-drift"
    if case != "bad-json":
        p.write_text(json.dumps(prof))
    rc, out, err = _main(tool, capsys, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and want in err, err
    assert str(p) in err or case in ("max-tokens", "drift-nan", "eval-missing")


@pytest.mark.slow
def test_reproduces_the_demo_tiny_build(tmp_path: Path) -> None:
    """build_profile on the tiny demo pair (eval text as a ``demo:`` reference), then perplexity.py on it."""
    from engine.demo.recipe import pair_dir

    if not (pair_dir("tiny") / "report.json").is_file():
        pytest.skip("the tiny demo pair is not built (python tools/make_demo_models.py --size tiny)")
    out = tmp_path / "tiny.json"
    r = _run(
        "--gpu",
        "a100",
        "--demo-size",
        "tiny",
        "--max-eval-tokens",
        "3000",
        "--out",
        out,
        "--device",
        "cpu",
        "--quiet",
        tool=BUILD,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())["quality"]
    assert rec["eval_text"] == f"demo:{pair_dir('tiny').name}/heldout.txt" and rec["max_tokens"] == 3000
    r = _run("--profile", out, "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["checks"] == {"drift": True, "kld": True, "reproduced": True}
    for k in ("ppl_ref", "ppl", "kld_mean", "top1"):
        assert got["quality"][k] == pytest.approx(rec[k], rel=1e-6, abs=1e-9), k

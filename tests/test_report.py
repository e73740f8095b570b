"""engine/build/plots.py and report.py: the bench plot's series and PNG, the build report, the tools writing them."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.api.profile import Profile
from engine.build.plots import aggregate_positions, bench_series, profile_series
from engine.build.report import build_report, build_report_files
from engine.cli.bench_modes import match_rate
from engine.core.errors import InvalidConfigError
from engine.spec_decode.adaptive import Costs, expected_speedup

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_tool(name: str) -> Any:
    return importlib.import_module(f"engine.cli.{name}")


def mode(name: str, tps: float, ppa: list | None = None) -> dict[str, Any]:
    row = {
        "name": name,
        "tokens_per_s": tps,
        "speedup_vs_plain": tps / 100.0,
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "predicted_speedup": None,
        "repeats": [tps],
    }
    if ppa is not None:
        row["per_position_acceptance"] = ppa
    return row


@pytest.fixture
def result() -> dict[str, Any]:
    """A hand-made bench result: plain 100 tok/s, adaptive model drafter, n-gram, fixed K 1, 2, 4."""
    runs = [
        {"k": 4, "mode": "specmix-model-k4", "speedup_vs_plain": 1.2},
        {"k": 1, "mode": "specmix-model-k1", "speedup_vs_plain": 1.1},
        {"k": 2, "mode": "specmix-model-k2", "speedup_vs_plain": 1.25},
    ]
    return {
        "modes": [
            mode("plain", 100.0),
            mode("specmix-model", 130.0, [0.8, 0.5, None]),
            mode("specmix-ngram", 90.0, [None, None]),
            mode("specmix-model-k1", 110.0, [0.7]),
            mode("specmix-model-k2", 125.0, [0.7, 0.6]),
            mode("specmix-model-k4", 120.0, [0.75, None, 0.5, 1.0]),
        ],
        "pair": {"target": "/models/t", "draft": "/models/d"},
        "settings": {"max_new_tokens": 16, "repeats": 3, "batch": 1},
        "sweep": {"acceptance": 0.7, "costs": {"c": 0.1, "v": {"1": 1.0, "2": 1.05, "4": 1.2}}, "runs": runs},
    }


def test_bench_series_exact(result):
    s = bench_series(result)
    costs = Costs(c=0.1, v={1: 1.0, 2: 1.05, 4: 1.2})
    assert s["speedup_vs_k"] == {
        "measured": {"k": [1, 2, 4], "speedup": [1.1, 1.25, 1.2]},
        "predicted": {"k": [1, 2, 3, 4], "speedup": [expected_speedup(0.7, k, costs) for k in (1, 2, 3, 4)]},
        "acceptance": 0.7,
        "c": 0.1,
        "adaptive": 1.3,
    }
    # the cost model by hand: K=1: (1 - a^2) / ((1 - a)(c + v(1))); K=3: v interpolated to 1.125
    assert s["speedup_vs_k"]["predicted"]["speedup"][0] == pytest.approx(0.51 / (0.3 * 1.1))
    assert s["speedup_vs_k"]["predicted"]["speedup"][2] == pytest.approx((1 - 0.7**4) / (0.3 * (0.3 + 1.125)))
    # the adaptive run, and of the sweep only its largest K; positions with no data are dropped
    assert s["acceptance_by_position"] == {
        "specmix-model": {"position": [1, 2], "acceptance": [0.8, 0.5]},
        "specmix-model-k4": {"position": [1, 3, 4], "acceptance": [0.75, 0.5, 1.0]},
    }
    assert s["tokens_per_s"] == {
        "modes": [
            "plain",
            "specmix-model",
            "specmix-ngram",
            "specmix-model-k1",
            "specmix-model-k2",
            "specmix-model-k4",
        ],
        "tokens_per_s": [100.0, 130.0, 90.0, 110.0, 125.0, 120.0],
        "plain": 100.0,
    }
    assert s["title"].startswith("models: t / d - batch 1")


def test_bench_series_without_sweep_or_plain(result):
    del result["sweep"]
    assert bench_series(result)["speedup_vs_k"] is None
    result["modes"] = result["modes"][1:]
    with pytest.raises(InvalidConfigError, match="plain"):
        bench_series(result)


def test_aggregate_positions_mean_over_requests():
    stats = [
        {"per_position_acceptance": [1.0, 0.5]},
        {"per_position_acceptance": [0.5, None, 1.0]},
        {"per_position_acceptance": []},
        {},
    ]
    assert aggregate_positions(stats) == {"acceptance": [0.75, 0.5, 1.0], "requests": [2, 1, 1]}
    assert aggregate_positions([]) == {"acceptance": [], "requests": []}


def check_png(path: Path) -> tuple[int, int]:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0
    return img.shape[1], img.shape[0]


def test_bench_png_opens(result, tmp_path):
    pytest.importorskip("matplotlib")
    from engine.build.plots import draw_bench

    (tmp_path / "b.png").write_bytes(draw_bench(bench_series(result)))
    w, h = check_png(tmp_path / "b.png")
    assert w > 2 * h  # three panels side by side
    del result["sweep"]  # no fixed-K runs: panel (a) says so instead of failing
    (tmp_path / "c.png").write_bytes(draw_bench(bench_series(result)))
    check_png(tmp_path / "c.png")


# ---------------------------------------------------------------------------- bench CLI
def run_bench(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = load_tool("bench").main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bench_plot_without_matplotlib_is_one_line_exit_2(tiny_demo, monkeypatch, capsys, tmp_path):
    bench = load_tool("bench")
    calls = []
    monkeypatch.setattr(bench.Engine, "from_pretrained", lambda *a, **k: calls.append(a))  # no benchmarking
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    t, d = tiny_demo
    rc = bench.main(["--target", str(t), "--draft", str(d), "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and calls == [] and not (tmp_path / "x.png").exists()
    assert len(err.strip().splitlines()) == 1 and "matplotlib" in err and "pip install" in err


@pytest.mark.parametrize("spec", ["1,x", "0,2", "-1"])
def test_bench_bad_sweep_is_one_line_exit_2(spec, capsys):
    rc, _, err = run_bench(["--sweep-k", spec], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--sweep-k" in err and "allowed" in err


def tiny_bench_args(tiny_demo: tuple[Path, Path], tmp_path: Path) -> list[str]:
    """A one-repeat, 8-token bench of the draft-model mode on the tiny pair and two prompts (no transformers)."""
    t, d = tiny_demo
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def fibonacci(n):\nThe with statement\n", encoding="utf-8")
    return [
        "--target",
        str(t),
        "--draft",
        str(d),
        "--prompts",
        str(prompts),
        "--repeats",
        "1",
        "--max-new-tokens",
        "8",
        "--no-hf",
        "--modes",
        "specmix-model",
        "--json",
        str(tmp_path / "r.json"),
    ]


def test_bench_sweep_json_and_plot_on_the_tiny_pair(tiny_demo, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, out, _ = run_bench(
        tiny_bench_args(tiny_demo, tmp_path)
        + ["--threads", "1", "--sweep-k", "1,3", "--plot", str(tmp_path / "r.png")],
        capsys,
    )
    assert rc == 0 and "specmix-model-k3" in out
    r = json.loads((tmp_path / "r.json").read_text())
    names = [m["name"] for m in r["modes"]]
    assert names == ["plain", "specmix-model", "specmix-model-k1", "specmix-model-k3"]
    for m in r["modes"]:  # the existing schema's fields stay
        assert {
            "name",
            "tokens_per_s",
            "speedup_vs_plain",
            "acceptance_rate",
            "mean_accepted_length",
            "predicted_speedup",
            "repeats",
        } <= set(m)
    for m in r["modes"]:  # fp32 greedy speculation is token-identical to the target alone
        assert m["match_vs_plain"] == {"identical": 1.0, "prefix": 1.0} == m["match_vs_float32"]
    assert r["settings"]["dtype"] == "float32"
    k3 = r["modes"][3]
    assert k3["fixed_k"] == 3 and len(k3["per_position_acceptance"]) <= 3 and k3["per_position_requests"][0] == 2
    sw = r["sweep"]
    assert [x["k"] for x in sw["runs"]] == [1, 3] and r["settings"]["sweep_k"] == [1, 3]
    assert 0 <= sw["acceptance"] <= 1
    costs = Costs.from_dict(sw["costs"])
    for run in sw["runs"]:
        assert run["predicted_speedup"] == pytest.approx(expected_speedup(sw["acceptance"], run["k"], costs))
    check_png(tmp_path / "r.png")


def test_bench_match_rate_on_hand_made_outputs():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    assert match_rate(ref, ref) == {"identical": 1.0, "prefix": 1.0}
    got = match_rate([[1, 2, 0, 4], [5, 6, 7, 8], [0, 9]], ref)  # prefixes 2/4, 4/4, 0/2
    assert got["identical"] == pytest.approx(1 / 3) and got["prefix"] == pytest.approx((0.5 + 1 + 0) / 3)
    with pytest.raises(ValueError):
        match_rate([[1]], ref)


def test_bench_bfloat16_reports_match_rates_against_float32(tiny_demo, tmp_path, capsys):
    from engine.kernels.cpu_linear import onednn_bf16_available

    if not onednn_bf16_available():
        pytest.skip("no oneDNN bf16 kernels on this CPU")
    rc, out, _ = run_bench(tiny_bench_args(tiny_demo, tmp_path) + ["--sweep-k", "", "--dtype", "bfloat16"], capsys)
    assert rc == 0 and "same as fp32" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["settings"]["dtype"] == "bfloat16" and r["settings"]["draft_dtype"] == "float32"
    assert r["settings"]["attention"] == "math_attention"
    for m in r["modes"]:  # exact against the bf16 target alone; against fp32 only measured
        assert m["match_vs_plain"] == {"identical": 1.0, "prefix": 1.0}
        assert 0.0 <= m["match_vs_float32"]["identical"] <= m["match_vs_float32"]["prefix"] <= 1.0


# ---------------------------------------------------------------------------- build report
@pytest.fixture(scope="module")
def built(tiny_demo, tmp_path_factory):
    """One tiny-pair build: (profile path, profile dict)."""
    out = tmp_path_factory.mktemp("built") / "a100.json"
    rc = load_tool("build_profile").main(
        ["--gpu", "a100", "--demo-size", "tiny", "--out", str(out), "--device", "cpu", "--quiet"]
    )
    assert rc == 0
    return out, json.loads(out.read_text())


def leaves(x: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from leaves(v, f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def as_written(path: str, x: Any) -> str:
    """How the report writes a leaf: floats to 6 significant digits; a gate attempt's `passed` as
    pass/FAIL; the probe's `greedy` as greedy/sampled; None as none."""
    if isinstance(x, bool):
        if path.endswith(".passed"):
            return "pass" if x else "FAIL"
        assert path.endswith(".greedy"), path
        return "greedy" if x else "sampled"
    if isinstance(x, float):
        return format(x, ".6g")
    return "none" if x is None else str(x)


def test_report_names_every_figure_of_quality_and_speculation(built):
    prof = copy.deepcopy(built[1])
    prof["quality"]["attempts"].insert(
        0,
        {
            **copy.deepcopy(prof["quality"]["attempts"][0]),
            "plan": "int8 test",
            "kld_mean": 0.0234567,
            "ppl": 81.234567,
            "passed": False,
        },
    )
    prof["speculation"]["per_position_acceptance"] = [0.61, 0.42, None]
    md = build_report(Profile.from_dict(prof, "edited"), "a100.png")
    found = list(leaves(prof["quality"], "quality")) + list(leaves(prof["speculation"], "speculation"))
    assert len(found) > 40
    missing = [(p, v) for p, v in found if as_written(p, v) not in md]
    assert not missing
    assert "KLD mean 0.0234567 > 0.01" in md  # the failed attempt's reason
    assert md.count("| FAIL |") == 1 and md.count("| pass | within both gates |") == 1
    assert "![predicted speedup vs K](a100.png)" in md
    ffn = prof["plan"]["target"]["families"]["ffn"]["kernel"]  # what the build measured best on this device
    for what in (f"int8 / {ffn}", "fp8_e4m3", "weight-only", "KV cache", "Chosen K"):
        assert what in md


def test_build_writes_report_and_plot_beside_the_profile(built):
    pytest.importorskip("matplotlib")
    path, prof = built
    md = path.with_suffix(".md").read_text(encoding="utf-8")
    assert md.startswith("# Build report: a100") and "![predicted speedup vs K](a100.png)" in md
    assert format(prof["quality"]["drift"], ".6g") in md
    check_png(path.with_suffix(".png"))
    assert sorted(p.name for p in path.parent.iterdir()) == ["a100.json", "a100.md", "a100.png"]  # no temp files


def test_report_of_the_loaded_profile_is_the_report_written(built):
    """What the report reads survives the profile's JSON: rendered again from the file, it is the same."""
    from engine.api.profile import load_profile

    path, _ = built
    files = build_report_files(load_profile(path), path)
    assert files[path.with_suffix(".md")] == path.with_suffix(".md").read_bytes()


def test_failed_build_leaves_the_previous_report_untouched(built, tmp_path, capsys):
    path, _ = built
    for ext in (".json", ".md", ".png"):
        shutil.copy(path.with_suffix(ext), tmp_path / f"p{ext}")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rc = load_tool("build_profile").main(
        [
            "--gpu",
            "a100",
            "--demo-size",
            "tiny",
            "--out",
            str(tmp_path / "p.json"),
            "--device",
            "cpu",
            "--quiet",
            "--max-drift",
            "1e-9",
            "--no-fallback",
        ]
    )
    assert rc == 1 and "no plan passed the gate" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_report_without_matplotlib_says_the_plot_was_skipped(built, monkeypatch, tmp_path):
    _, prof = built
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    files = build_report_files(Profile.from_dict(prof), tmp_path / "p.json")
    assert files[tmp_path / "p.png"] is None
    md = files[tmp_path / "p.md"].decode("utf-8")
    assert "Plot skipped: matplotlib is not installed" in md and "![" not in md


def test_profile_plot_with_per_position_acceptance(built, tmp_path):
    pytest.importorskip("matplotlib")
    from engine.build.plots import draw_profile

    _, prof = built
    s = profile_series(Profile.from_dict(prof))
    sp = prof["speculation"]
    costs = Costs.from_dict({"c": sp["c"], "v": sp["v"]})
    assert s["k"] == list(range(1, 9))
    assert s["curves"]["FP8 draft (planned)"]["speedup"] == [
        expected_speedup(sp["acceptance"], k, costs) for k in s["k"]
    ]
    assert s["chosen"]["predicted_speedup"] == pytest.approx(s["curves"]["FP8 draft (planned)"]["speedup"][sp["k"] - 1])
    (tmp_path / "one.png").write_bytes(draw_profile(s))
    prof = copy.deepcopy(prof)
    prof["speculation"]["per_position_acceptance"] = [0.6, 0.4]
    (tmp_path / "two.png").write_bytes(draw_profile(profile_series(Profile.from_dict(prof))))
    assert check_png(tmp_path / "two.png")[0] > check_png(tmp_path / "one.png")[0]  # a second panel

"""tools/bench_serve.py: statistics against numpy, datasets, arrivals, and short runs against live servers."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from test_openai_server import Live, _chat_checkpoint  # noqa: E402

from engine.cli import bench_serve, serve_load, serve_report, serve_stats  # noqa: E402
from engine.cli.serve_stats import RequestResult  # noqa: E402

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


# ---------------------------------------------------------------- statistics
@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_is_numpys(n):
    xs = np.random.default_rng(n).lognormal(size=n).tolist()
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert serve_stats.percentile(xs, q) == pytest.approx(np.percentile(xs, q), rel=1e-12)
    assert math.isnan(serve_stats.percentile([], 50))


def _synthetic(n: int, seed: int) -> list[RequestResult]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = int(rng.integers(1, 40))
        gaps = rng.exponential(0.03, size=int(rng.integers(1, tokens + 1)) - 1)
        ttft = float(rng.exponential(0.3))
        chunks = (ttft + np.concatenate([[0.0], np.cumsum(gaps)])).tolist()
        e2el = chunks[-1] + float(rng.exponential(0.005))
        out.append(RequestResult(True, ttft, e2el, chunks, tokens, int(rng.integers(5, 50))))
    return out


def test_summary_and_goodput_against_numpy():
    rs = _synthetic(300, 1) + [RequestResult(False, error="HTTP 503")]
    wall = 12.5
    slos = serve_stats.parse_goodput(["ttft:400", "tpot:35", "e2el:1000"])
    got = serve_stats.summarize(rs, wall, slos)
    ok = rs[:-1]
    ttft, e2el = np.array([r.ttft for r in ok]), np.array([r.e2el for r in ok])
    toks = np.array([r.output_tokens for r in ok])
    many = toks > 1
    tpot = (e2el - ttft)[many] / (toks[many] - 1)
    itl = np.concatenate([np.diff(r.chunk_times) for r in ok])
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert got[f"mean_{name}_ms"] == pytest.approx(1000 * xs.mean())
        assert got[f"median_{name}_ms"] == pytest.approx(1000 * np.median(xs))
        assert got[f"p99_{name}_ms"] == pytest.approx(1000 * np.percentile(xs, 99))
    assert got["completed"] == 300 and got["failed"] == 1 and got["errors"] == ["HTTP 503"]
    assert got["output_throughput"] == pytest.approx(toks.sum() / wall)
    assert got["request_throughput"] == pytest.approx(300 / wall)
    tpot_all = np.where(many, (e2el - ttft) / np.maximum(toks - 1, 1), 0.0)  # one token: no TPOT to miss
    good = (ttft <= 0.4) & (tpot_all <= 0.035) & (e2el <= 1.0)
    assert 0 < good.sum() < 300  # the SLOs bind
    assert got["good_requests"] == good.sum() and got["goodput"] == pytest.approx(good.sum() / wall)
    assert serve_stats.summarize(rs, wall, {})["goodput"] is None


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "itl:50", "ttft:x", "ttft:-1", "e2el:inf", "tpot:0"])
def test_goodput_syntax(bad):
    assert serve_stats.parse_goodput(["ttft:500", "tpot:50", "e2el:3000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 3.0}
    with pytest.raises(ValueError, match="--goodput"):
        serve_stats.parse_goodput([bad])


def test_speculation_from_two_scrapes():
    def text(drafts, pos, k):
        lines = [f'specmix:spec_decode_num_drafts_total{{model_name="m"}} {drafts}']
        lines += [
            f'specmix:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i + 1}"}} {a}'
            for i, a in enumerate(pos)
        ]
        lines += [f'specmix:spec_decode_tuned_k{{model_name="m",batch_bucket="{b}"}} {v}' for b, v in k.items()]
        return "# HELP x y\n" + "\n".join(lines)

    before = serve_load.parse_metrics(text(10.0, [8.0, 5.0], {1: 4}))
    after = serve_load.parse_metrics(text(30.0, [24.0, 13.0, 2.0], {1: 5, 16: 0}))
    got = serve_stats.speculation(before, after)
    assert got["drafts"] == 20 and got["accepted_per_pos"] == [16, 8, 2]
    assert got["acceptance_per_pos"] == [0.8, 0.4, 0.1]
    assert got["mean_accepted_length"] == pytest.approx(1 + 26 / 20)
    assert got["tuned_k"] == {"1": 5, "16": 0}
    assert serve_stats.speculation(after, after)["mean_accepted_length"] is None


def test_the_tuner_against_the_best_fixed_k():
    def row(config, x, tok_s, temp=0.0):
        return {"config": config, "mode": "concurrency", "concurrency": x, "rate": None, "temperature": temp,
                "output_throughput": tok_s, "p99_ttft_ms": 100.0}  # fmt: skip

    rows = [row("on", 1, 90.0), row("off", 1, 50.0), row("fixed2", 1, 80.0), row("fixed5", 1, 100.0)]
    rows += [row("on", 16, 95.0), row("off", 16, 100.0), row("fixed2", 16, 70.0), row("fixed5", 16, 60.0)]
    rows += [row("on", 1, 70.0, 0.7), row("off", 1, 50.0, 0.7)]  # no sweep at this point: no comparison
    rows += [row("on", 2, 70.0), row("fixed2", 2, 80.0), row("fixed5", 2, 100.0)]  # a sweep without off
    sp = {(s["config"], s["x"], s["temperature"]): s for s in serve_report.speedups(rows)}
    assert sp[("on", 1, 0.0)]["vs_best_fixed"] == pytest.approx(0.9) and sp[("on", 1, 0.0)]["best_fixed"] == "fixed5"
    assert sp[("on", 16, 0.0)]["vs_best_fixed"] == pytest.approx(0.95) and sp[("on", 16, 0.0)]["best_fixed"] == "off"
    assert sp[("on", 1, 0.7)]["vs_best_fixed"] is None and sp[("on", 1, 0.7)]["speedup"] == pytest.approx(1.4)
    assert sp[("fixed2", 16, 0.0)]["vs_best_fixed"] is None and sp[("fixed2", 16, 0.0)]["speedup"] == pytest.approx(0.7)
    assert sp[("on", 2, 0.0)]["vs_best_fixed"] == pytest.approx(0.7) and sp[("on", 2, 0.0)]["speedup"] is None
    assert "0.90x (fixed5)" in serve_report.table([], list(sp.values()))


# ---------------------------------------------------------------- datasets and arrivals
def test_poisson_arrivals_mean_rate():
    for rate in (0.5, 4.0, 50.0):
        t = serve_load.arrival_times(4000, rate, seed=3)
        assert t[0] == 0 and all(b >= a for a, b in zip(t, t[1:]))
        assert (len(t) - 1) / t[-1] == pytest.approx(rate, rel=0.08)
        gaps = np.diff(t)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential: CV 1
    assert serve_load.arrival_times(5, 2.0, seed=1) == serve_load.arrival_times(5, 2.0, seed=1)
    assert serve_load.arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        serve_load.arrival_times(3, 0.0)


def test_jsonl_dataset(tmp_path):
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "a b c", "output_len": 3}, {"messages": MESSAGES}, {}]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    items = serve_load.load_jsonl(f)
    assert items == [serve_load.Item(prompt="a b c", output_len=3), serve_load.Item(messages=MESSAGES)]
    assert serve_load.take(items, 5)[4] == items[0]
    for bad in ({}, {"prompt": 3}, {"prompt": "x", "messages": MESSAGES}, {"prompt": "x", "output_len": 0}, [1]):
        f.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=":2:"):
            serve_load.load_jsonl(f)


def test_request_seeds(tmp_path):
    """--request-seeds gives request i the seed --seed + i, sent in its body; without it no seed is sent."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a b c"}) + "\n" + json.dumps({"messages": MESSAGES}) + "\n")
    args = bench_serve.build_parser().parse_args(["--dataset", str(f), "--seed", "40", "--request-seeds"])
    items = bench_serve.dataset(args, 3)
    assert [it.seed for it in items] == [40, 41, 42]
    sampling = serve_load.Sampling(max_tokens=4, temperature=0.7)
    assert [serve_load.request_body("m", it, sampling)[1]["seed"] for it in items] == [40, 41, 42]
    plain = bench_serve.dataset(bench_serve.build_parser().parse_args(["--dataset", str(f)]), 3)
    assert all("seed" not in serve_load.request_body("m", it, sampling)[1] for it in plain)


def test_random_dataset(ckpt_dir):
    from engine.core.tokenizer import Tokenizer

    tok = Tokenizer(ckpt_dir)
    items = serve_load.random_items(ckpt_dir, 6, input_len=50, output_len=7, seed=5)
    assert items == serve_load.random_items(ckpt_dir, 6, input_len=50, output_len=7, seed=5)
    assert items != serve_load.random_items(ckpt_dir, 6, input_len=50, output_len=7, seed=6)
    for it in items:
        assert isinstance(it.prompt, list) and len(it.prompt) == 50 and it.output_len == 7
        assert all(0 <= i < tok.vocab_size and tok.decode([i]) for i in it.prompt)
    assert len({i for it in items for i in it.prompt}) > 100  # spread over the vocabulary (300)


# ---------------------------------------------------------------- live runs
@pytest.fixture(scope="module")
def chat_dir(ckpt_dir, tmp_path_factory):
    return _chat_checkpoint(ckpt_dir, tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def live(chat_dir):
    from engine import Engine
    from engine.api.options import Limits, SpeculationConfig

    spec = SpeculationConfig(drafter="ngram", k=3)
    eng = Engine.from_pretrained(chat_dir, speculation=spec, limits=Limits(max_batch=8))
    srv = Live(eng)
    yield srv
    srv.close()


def _check(results: list[RequestResult], n: int, tokens: list[int]) -> None:
    assert len(results) == n and all(r.ok for r in results), [r.error for r in results]
    assert sorted(r.output_tokens for r in results) == sorted(tokens)
    for r in results:
        assert 0 < r.ttft <= r.e2el and r.chunk_times[0] == r.ttft and r.chunk_times[-1] <= r.e2el
        assert r.prompt_tokens > 0 and all(g >= 0 for g in r.itls)


def test_closed_and_open_loop_against_a_live_server(live):
    items = [
        serve_load.Item(prompt="The quick brown"),
        serve_load.Item(prompt=[5, 6, 7, 8], output_len=5),
        serve_load.Item(messages=MESSAGES, output_len=9),
    ] * 2
    want = [6, 5, 9] * 2
    for temp in (0.0, 0.7):
        sampling = serve_load.Sampling(max_tokens=6, temperature=temp)
        results, wall = asyncio.run(serve_load.run_closed_loop(live.url, "m", items, sampling, 2))
        _check(results, 6, want)
        summ = serve_stats.summarize(results, wall, {})
        assert summ["total_output_tokens"] == sum(want) and summ["completed"] == 6
        assert summ["median_ttft_ms"] <= summ["median_e2el_ms"] and summ["output_throughput"] > 0
        results, wall = asyncio.run(serve_load.run_open_loop(live.url, "m", items, sampling, 20.0, seed=1))
        _check(results, 6, want)
        assert wall >= serve_load.arrival_times(6, 20.0, seed=1)[-1]


FINISHED = "specmix:request_success_total"


def test_the_command_against_a_url(live, tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "The quick brown"}) + "\n" + json.dumps({"messages": MESSAGES}) + "\n")
    out = tmp_path / "o.json"
    argv = ["--url", live.url, "--concurrency", "1", "2", "--request-rate", "inf", "--num-prompts", "4"]
    argv += ["--dataset", str(data), "--output-len", "6", "--goodput", "ttft:600000", "--json", str(out)]
    finished = lambda: sum(v for (name, _), v in serve_load.scrape(live.url).items() if name == FINISHED)  # noqa: E731
    before = finished()
    assert bench_serve.main([*argv, "--temperature", "0", "0.7"]) == 0
    assert finished() - before == 6 * 4 + 2  # the measured requests, and a warm-up at each temperature
    got = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"], r["rate"], r["temperature"]) for r in got["rows"]] == [
        ("concurrency", 1, None, 0.0),
        ("concurrency", 2, None, 0.0),
        ("rate", None, "inf", 0.0),
        ("concurrency", 1, None, 0.7),
        ("concurrency", 2, None, 0.7),
        ("rate", None, "inf", 0.7),
    ]
    for r in got["rows"]:
        assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 24
        assert r["goodput"] == pytest.approx(r["request_throughput"])
        assert r["median_ttft_ms"] <= r["median_e2el_ms"] and r["p99_ttft_ms"] <= r["p99_e2el_ms"]
        spec = r["speculation"]
        assert spec["drafts"] >= 0 and sum(spec["accepted_per_pos"]) <= 3 * spec["drafts"]
        assert spec["mean_accepted_length"] is None or 1 <= spec["mean_accepted_length"] <= 4
    assert got["speedups"] == []  # one server: nothing to compare


def test_the_random_dataset_against_a_url(live, chat_dir, tmp_path):
    out = tmp_path / "o.json"
    argv = ["--url", live.url, "--concurrency", "2", "--num-prompts", "3", "--dataset", "random"]
    argv += ["--input-len", "20", "--output-len", "5", "--tokenizer", str(chat_dir), "--json", str(out)]
    assert bench_serve.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["total_input_tokens"] == 60 and row["total_output_tokens"] == 15


def test_one_command_starts_speculation_on_and_off(ckpt_dir, draft_dir, tmp_path):
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    argv = ["--target", str(ckpt_dir), "--draft", str(draft_dir), "--concurrency", "1", "2", "--request-rate", "50"]
    argv += ["--num-prompts", "3", "--dataset", "random", "--input-len", "8", "--output-len", "6"]
    assert bench_serve.main([*argv, "--json", str(out), "--plot", str(png), "--", "--k", "3"]) == 0
    got = json.loads(out.read_text())
    assert [r["config"] for r in got["rows"]] == ["on", "off"] * 3
    assert [(s["mode"], s["x"]) for s in got["speedups"]] == [("concurrency", 1), ("concurrency", 2), ("rate", 50.0)]
    assert all(s["speedup"] > 0 for s in got["speedups"])
    on, off = got["rows"][0]["speculation"], got["rows"][1]["speculation"]
    # the tuner drafts in its exploration rounds at least, wherever plain rounds measure faster on this machine
    assert sum(r["speculation"]["drafts"] for r in got["rows"][::2]) > 0
    assert (on["mean_accepted_length"] is None or 1 <= on["mean_accepted_length"] <= 4) and on["tuned_k"]
    assert off["drafts"] == 0 and off["mean_accepted_length"] is None
    assert all(r["total_output_tokens"] == 18 for r in got["rows"])
    assert png.stat().st_size > 10_000


def test_argument_errors(capsys):
    with pytest.raises(SystemExit):
        bench_serve.main(["--concurrency", "1"])
    with pytest.raises(SystemExit):
        bench_serve.main(["--concurrency", "1", "--", "--profile", "p.json"])
    assert "--no-spec with --profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_serve.main(["--url", "http://127.0.0.1:1", "--goodput", "itl:5"])
    with pytest.raises(SystemExit):
        bench_serve.main(["--url", "http://127.0.0.1:1", "--dataset", "random"])
    assert "--tokenizer" in capsys.readouterr().err
    assert bench_serve.split_argv(["--url", "u", "--", "--target", "t"]) == (["--url", "u"], ["--target", "t"])


def test_a_points_requests_by_default():
    """4 per client, at least 32 (runs of 8 at concurrency 1 spread by 11%); 32 per request rate; or as given."""
    args = bench_serve.build_parser().parse_args([])
    assert [bench_serve.point_size(args, "concurrency", c) for c in (1, 8, 16, 64)] == [32, 32, 64, 256]
    assert bench_serve.point_size(args, "rate", 2.0) == 32
    args = bench_serve.build_parser().parse_args(["--num-prompts", "5"])
    assert bench_serve.point_size(args, "concurrency", 64) == 5

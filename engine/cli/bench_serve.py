"""Serving benchmark of OpenAI-compatible servers, as ``vllm bench serve`` reports it, speculation on vs off.

    # start specmix-serve with your flags (after --) and again with --no-spec; compare them
    python tools/bench_serve.py --concurrency 1 2 4 8 16 --temperature 0 0.7 --json out.json --plot out.png \\
        -- --target DIR --drafter ngram
    python tools/bench_serve.py --target DIR --draft DIR --request-rate 1 2 4 inf --goodput ttft:500 tpot:50
    # one running server
    python tools/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 4 16
    # datasets: a JSONL ("prompt" or "messages", optional "output_len"), or random token ids
    python tools/bench_serve.py ... --dataset prompts.jsonl
    python tools/bench_serve.py ... --dataset random --input-len 128 --output-len 64
    # sampled requests that carry seeds (request i: --seed + i)
    python tools/bench_serve.py ... --temperature 0.7 --request-seeds

Modes: closed loop (``--concurrency``: N clients, each sending its next request when its last ends) and
open loop (``--request-rate``: Poisson arrivals, requests/s; inf sends all at once). Every request
streams with ``stream_options.include_usage`` and ``ignore_eos``, so each configuration emits the same
number of tokens. Figures (engine/cli/serve_stats.py): output tokens/s, requests/s, goodput under
``--goodput`` SLOs, TTFT, TPOT, ITL and end-to-end latency (mean, median, p99); from the server's
/metrics, scraped before and after each point: acceptance per draft position, mean accepted length, the
K tuner's K per batch bucket. With the servers started here, the configurations run side by side,
point by point and repeat by repeat interleaved, and ``--repeats`` gives each figure's median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.cli.serve_load import Item, Sampling
    from engine.cli.serve_stats import Series

log = logging.getLogger("bench_serve")

# "fixedK": K drafts every round (K = 1..8); with "off" (K = 0) a sweep of fixed K for the tuner ("on") to match;
# "nocut": the tuner without the per-row cut of copied chains (SpeculationConfig.draft_cut)
CONFIGS = {
    "on": [],
    "nocut": ["--no-draft-cut"],
    "off": ["--no-spec"],
    **{f"fixed{k}": ["--k", str(k), "--k-policy", "constant"] for k in range(1, 9)},
}


@dataclass(frozen=True)
class Server:
    config: str
    url: str
    model: str


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="specmix-bench-serve",
        description=__doc__.splitlines()[0],
        epilog="Arguments after -- go to every specmix-serve started (with --configs' additions).",
    )
    ap.add_argument("--url", help="a running server (a single run; else servers are started, one per --configs)")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--target", help="shorthand for -- --target DIR (and the random dataset's tokenizer)")
    ap.add_argument("--draft", help="shorthand for -- --draft DIR")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["on", "off"],
        choices=list(CONFIGS),
        help="servers to compare: on (the default K tuner), off (--no-spec), fixedK (K constant, 1..8), nocut "
        "(--no-draft-cut)",
    )
    ap.add_argument("--concurrency", nargs="+", type=int, default=None, help="closed-loop clients (default 1 4 16)")
    ap.add_argument("--request-rate", "--rate", nargs="+", type=float, default=None, help="Poisson requests/s, inf")
    ap.add_argument(
        "--num-prompts",
        "--num-requests",
        type=int,
        default=None,
        help="per point (default: 4 x concurrency, >= 32; 32 at a rate)",
    )
    ap.add_argument("--dataset", default=None, help="FILE.jsonl or 'random' (default: held-out demo corpus)")
    ap.add_argument("--input-len", type=int, default=128, help="tokens of a random prompt")
    ap.add_argument("--output-len", "--max-tokens", type=int, default=128, help="tokens per request (default)")
    ap.add_argument("--prompt-words", type=int, default=48, help="words of a default prompt")
    ap.add_argument("--tokenizer", default=None, help="for --dataset random (default: --target)")
    ap.add_argument("--temperature", nargs="+", type=float, default=[0.0], help="each value a separate run")
    ap.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS", help="SLOs: ttft, tpot, e2el in ms")
    ap.add_argument("--repeats", type=int, default=1, help="runs per point; each figure is the median")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-seeds", action="store_true", help="request i carries seed = --seed + i")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--plot", help="PNG: speedup vs concurrency, TTFT/TPOT vs request rate (the plot extra)")
    return ap


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's arguments, those after -- for specmix-serve)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def serve_args(args: argparse.Namespace, extra: Sequence[str]) -> list[str]:
    own = [(f, v) for f, v in (("--target", args.target), ("--draft", args.draft)) if v]
    return [x for fv in own for x in fv] + list(extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, logfile: Path, config: str, timeout_s: float = 600) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = logfile.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"specmix-serve ({config}) exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"specmix-serve ({config}) not healthy after {timeout_s:.0f} s (log: {logfile})")


@contextlib.contextmanager
def spawn(base: Sequence[str], config: str, max_batch: int, logdir: Path) -> Iterator[str]:
    """specmix-serve with ``base`` + the config's flags on a free port of 127.0.0.1; yields its URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.cli.serve", *base, *CONFIGS[config]]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    if "--max-batch" not in base:
        cmd += ["--max-batch", str(max_batch)]
    logfile = logdir / f"serve-{config}.log"
    log.info("starting %s (log %s)", " ".join(cmd[1:]), logfile)
    with logfile.open("w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, logfile, config)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _flag(argv: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in an argument list (None when absent)."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _model(url: str, given: str | None) -> str:
    import httpx

    return given or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def main(argv: Sequence[str] | None = None) -> int:
    own, extra = split_argv(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(own)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    base = args.serve_args = serve_args(args, extra)
    if not args.url and not base:
        ap.error("give --url, or the server's flags (--target DIR, or -- --profile FILE ...)")
    if not args.url and "--profile" in base and "off" in args.configs:
        ap.error("specmix-serve refuses --no-spec with --profile (the profile fixes speculation): use --target/--draft")
    if args.dataset == "random" and not (args.tokenizer or args.target or _flag(base, "--target")):
        ap.error("--dataset random needs --tokenizer DIR (or --target)")
    from engine.cli.serve_stats import parse_goodput

    try:
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        ap.error(str(e))
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = [1, 4, 16]
    with contextlib.ExitStack() as stack:
        if args.url:
            servers = [Server("url", args.url.rstrip("/"), _model(args.url.rstrip("/"), args.model))]
        else:
            logdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serve-")))
            top = max([64, *(args.concurrency or [])])
            servers = []
            for cfg in args.configs:
                url = stack.enter_context(spawn(base, cfg, top, logdir))
                servers.append(Server(cfg, url, _model(url, args.model)))
        rows = run_all(args, servers, slos)
    return report(args, rows, slos)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], slos: dict[str, float]) -> int:
    from engine.cli.serve_report import plot, speedups, table

    sp = speedups(rows)
    print(table(rows, sp))
    if args.json:
        from engine.core.files import write_json_atomic

        own, extra = vars(args), {"slos_s": slos, "host_cpus": os.cpu_count()}
        data = {"rows": rows, "speedups": sp, "args": own, **extra}
        write_json_atomic(Path(args.json), jsonable(data))
    if args.plot:
        plot(rows, sp, Path(args.plot))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def jsonable(x: Any) -> Any:
    """Strict JSON: nan as null, an infinite rate as "inf"."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def points(args: argparse.Namespace) -> list[tuple[str, float]]:
    return [("concurrency", c) for c in args.concurrency or []] + [("rate", r) for r in args.request_rate or []]


def run_all(args: argparse.Namespace, servers: Sequence[Server], slos: dict[str, float]) -> list[dict[str, Any]]:
    """Every (temperature, point): each server's repeats, interleaved; one row per server and point."""
    from tqdm import tqdm

    from engine.cli.serve_load import Sampling, scrape, warm_up

    todo = [(t, p) for t in args.temperature for p in points(args)]
    longest = max(dataset(args, max(point_size(args, mode, x) for _, (mode, x) in todo)), key=item_size)
    for s in servers:  # the run's longest request first: no server grows its KV cache inside a measured request;
        for temp in args.temperature:  # and one per temperature: a sampled round's first use is not measured either
            asyncio.run(warm_up(s.url, s.model, longest, Sampling(args.output_len, temp)))
    rows = []
    for temp, (mode, x) in tqdm(todo, desc="points", disable=None):
        items = dataset(args, point_size(args, mode, x))
        sampling = Sampling(max_tokens=args.output_len, temperature=temp)
        before = {s.config: scrape(s.url) for s in servers}
        runs: dict[str, list[dict[str, Any]]] = {s.config: [] for s in servers}
        for rep in range(args.repeats):
            for s in servers:
                runs[s.config].append(run_point(s, items, sampling, mode, x, slos, args.seed + rep))
        for s in servers:
            rows.append(point_row(s, mode, x, temp, runs[s.config], before[s.config], scrape(s.url)))
            log.info("%s %s=%s temperature %s: %.1f tok/s", s.config, mode, x, temp, rows[-1]["output_throughput"])
    return rows


def point_size(args: argparse.Namespace, mode: str, x: float) -> int:
    """Requests per point: --num-prompts, else 4 x the concurrency (at least 32: runs of 8 at concurrency 1
    spread by 11%), or 32 per request rate."""
    return args.num_prompts or (max(32, 4 * int(x)) if mode == "concurrency" else 32)


def item_size(item: Item) -> int:
    """A request's length for choosing the warm-up: its prompt's characters or token ids, or its messages' text."""
    text = item.prompt if item.prompt is not None else json.dumps(item.messages)
    return len(text) + (item.output_len or 0)


def run_point(
    s: Server, items: list[Item], sampling: Sampling, mode: str, x: float, slos: dict[str, float], seed: int
) -> dict[str, Any]:
    """One run of one point against one server: its summary."""
    from engine.cli.serve_load import run_closed_loop, run_open_loop
    from engine.cli.serve_stats import summarize

    if mode == "concurrency":
        results, wall = asyncio.run(run_closed_loop(s.url, s.model, items, sampling, int(x)))
    else:
        results, wall = asyncio.run(run_open_loop(s.url, s.model, items, sampling, x, seed))
    return summarize(results, wall, slos)


def point_row(
    s: Server, mode: str, x: float, temp: float, runs: list[dict[str, Any]], before: Series, after: Series
) -> dict[str, Any]:
    from engine.cli.serve_report import median_row
    from engine.cli.serve_stats import speculation

    return {
        "config": s.config,
        "mode": mode,
        "concurrency": int(x) if mode == "concurrency" else None,
        "rate": x if mode == "rate" else None,
        "temperature": temp,
        **median_row(runs),
        "speculation": speculation(before, after),
        "repeats": runs,
    }


def dataset(args: argparse.Namespace, n: int) -> list[Item]:
    """n requests of --dataset (cycled when it has fewer), request i seeded with --seed + i under --request-seeds."""
    from engine.cli import serve_load

    if args.dataset is None:
        items = serve_load.default_items(n, args.prompt_words, args.seed)
    elif args.dataset == "random":
        tok = args.tokenizer or args.target or _flag(args.serve_args, "--target")
        items = serve_load.random_items(tok, n, args.input_len, args.output_len, args.seed)
    else:
        items = serve_load.take(serve_load.load_jsonl(args.dataset), n)
    return [replace(it, seed=args.seed + i) for i, it in enumerate(items)] if args.request_seeds else items


if __name__ == "__main__":
    sys.exit(main())

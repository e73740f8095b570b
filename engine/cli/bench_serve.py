"""Serving benchmark against OpenAI-compatible servers: output tokens/s, TTFT, inter-token latency.

    # one running server
    python tools/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1 4 16
    # start the servers itself (speculation on, off, and a fixed K=5 window) and compare them
    python tools/bench_serve.py --target DIR --draft DIR --configs on off fixed5 --concurrency 1 4 16 --json out.json
    # a request-rate mode (Poisson arrivals, requests/s) instead of closed-loop clients
    python tools/bench_serve.py --url URL --rate 4 --num-requests 64

Every request streams a greedy completion of exactly --max-tokens tokens (ignore_eos), so each
configuration emits the same tokens. TTFT: submission to the first content chunk. Inter-token
latency (ITL): per request, (last chunk - first chunk) / (tokens - 1), i.e. time per output token
after the first. Figures are p50/p99 over requests; tokens/s is all output tokens over the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("bench_serve")

CONFIGS = {"on": [], "off": ["--no-spec"], "fixed5": ["--k", "5", "--k-policy", "constant"]}


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    """Held-out demo-corpus passages (never the eval text)."""
    from engine.demo.recipe import demo_texts

    text = demo_texts()["heldout"].split()
    rng = random.Random(seed)
    return [" ".join(text[(s := rng.randrange(len(text) - words)) : s + words]) for _ in range(n)]


async def one(client: Any, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            if obj.get("choices") and obj["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    first = first or end
    last = last or end
    return {"ttft": first - t0, "itl": (last - first) / max(1, tokens - 1), "e2e": end - t0, "tokens": tokens}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else float("nan")


async def run_load(
    url: str, model: str, texts: list[str], max_tokens: int, concurrency: int | None, rate: float | None, seed: int = 0
) -> dict[str, Any]:
    import httpx

    results: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=max(64, concurrency or 0))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, url, model, texts[0], 4)  # warm-up
        t0 = time.perf_counter()
        if rate is None:
            queue = list(texts)

            async def worker() -> None:
                while queue:
                    results.append(await one(client, url, model, queue.pop(), max_tokens))

            await asyncio.gather(*[worker() for _ in range(concurrency or 1)])
        else:
            rng = random.Random(seed)
            tasks = []
            for p in texts:
                tasks.append(asyncio.create_task(one(client, url, model, p, max_tokens)))
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "rate": rate,
        "requests": len(results),
        "output_tokens": toks,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(toks / wall, 2),
        **{
            f"{k}_p{q}_ms": round(1000 * _pct([r[k] for r in results], q), 2)
            for k in ("ttft", "itl", "e2e")
            for q in (50, 99)
        },
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: argparse.Namespace, config: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli.serve",
        "--target",
        args.target,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-batch",
        str(max(64, max(args.concurrency))),
    ]
    if args.draft and config != "off":
        cmd += ["--draft", args.draft]
    cmd += CONFIGS[config]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"server {config} exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server {config} did not start")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (else --target starts one per --configs entry)")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--configs", nargs="+", default=["on", "off"], choices=sorted(CONFIGS))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead of clients")
    ap.add_argument("--num-requests", type=int, default=None, help="default: 4 x concurrency (>= 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=48)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not args.url and not args.target:
        ap.error("give --url or --target")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    rows = []
    servers = [("url", None, args.url)] if args.url else []
    for cfg in [] if args.url else args.configs:
        proc, url = spawn(args, cfg)
        servers.append((cfg, proc, url))
        try:
            rows += _bench_one(args, cfg, url)
        finally:
            proc.terminate()
            proc.wait(30)
    if args.url:
        rows += _bench_one(args, "url", args.url)
    hdr = ("config", "conc", "rate", "reqs", "tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99")
    print(" | ".join(hdr))
    for r in rows:
        print(
            " | ".join(
                str(x)
                for x in (
                    r["config"],
                    r["concurrency"],
                    r["rate"],
                    r["requests"],
                    r["tokens_per_s"],
                    r["ttft_p50_ms"],
                    r["ttft_p99_ms"],
                    r["itl_p50_ms"],
                    r["itl_p99_ms"],
                )
            )
        )
    if args.json:
        from engine.core.files import write_json_atomic

        write_json_atomic(Path(args.json), {"rows": rows, "args": vars(args), "host_cpus": os.cpu_count()})
    return 0


def _bench_one(args: argparse.Namespace, cfg: str, url: str) -> list[dict[str, Any]]:
    import httpx

    model = args.model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    out = []
    for conc in [None] if args.rate else args.concurrency:
        n = args.num_requests or max(8, 4 * (conc or 1))
        texts = prompts(n, args.prompt_words)
        r = asyncio.run(run_load(url, model, texts, args.max_tokens, conc, args.rate))
        r["config"] = cfg
        log.info("%s: %s", cfg, r)
        out.append(r)
    return out


if __name__ == "__main__":
    sys.exit(main())

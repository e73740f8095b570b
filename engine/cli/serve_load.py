"""The serving benchmark's load (tools/bench_serve.py): datasets, arrivals, streamed requests, /metrics.

A request streams from ``/v1/completions`` (a prompt: text or token ids) or ``/v1/chat/completions``
(messages) with ``stream_options.include_usage``, so its token counts come from the last chunk's
``usage``; its times come from the chunks as they arrive (httpx streaming).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from engine.cli.serve_stats import RequestResult


@dataclass(frozen=True)
class Item:
    """One request of a dataset: a prompt (text or token ids) or chat messages; output_len None: the default."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    output_len: int | None = None
    seed: int | None = None  # the request's "seed" (None: none sent)


@dataclass(frozen=True)
class Sampling:
    """What every request of a run asks for besides its item."""

    max_tokens: int
    temperature: float
    ignore_eos: bool = True


# ---------------------------------------------------------------- datasets
def load_jsonl(path: str | Path) -> list[Item]:
    """One JSON object per line: "prompt" (a string) or "messages" (a chat list), optional "output_len" (int >= 1)."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        where = f"{path}:{n}"
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object")
        prompt, messages, out_len = obj.get("prompt"), obj.get("messages"), obj.get("output_len")
        if (prompt is None) == (messages is None):
            raise ValueError(f"{where}: give exactly one of 'prompt' (a string) and 'messages' (a list)")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise ValueError(f"{where}: 'messages' must be a list of objects")
        if out_len is not None and (isinstance(out_len, bool) or not isinstance(out_len, int) or out_len < 1):
            raise ValueError(f"{where}: 'output_len' must be an integer >= 1")
        items.append(Item(prompt=prompt, messages=messages, output_len=out_len))
    if not items:
        raise ValueError(f"{path}: no requests")
    return items


def random_items(tokenizer_dir: str | Path, n: int, input_len: int, output_len: int, seed: int = 0) -> list[Item]:
    """n prompts of input_len token ids drawn uniformly from the vocabulary (a special token is redrawn), seeded."""
    from engine.core.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    bound = tok.vocab_size
    special: dict[int, bool] = {}

    def draw() -> int:
        while True:
            i = rng.randrange(bound)
            if i not in special:
                special[i] = tok.decode([i], skip_special_tokens=True) == ""
            if not special[i]:
                return i

    return [Item(prompt=[draw() for _ in range(input_len)], output_len=output_len) for _ in range(n)]


def default_items(n: int, words: int, seed: int = 0) -> list[Item]:
    """Held-out demo-corpus passages of ``words`` words (never the eval text)."""
    from engine.demo.recipe import demo_texts

    text = demo_texts()["heldout"].split()
    rng = random.Random(seed)
    return [Item(prompt=" ".join(text[(s := rng.randrange(len(text) - words)) : s + words])) for _ in range(n)]


def take(items: Sequence[Item], n: int) -> list[Item]:
    """The first n items, cycling when there are fewer."""
    return [items[i % len(items)] for i in range(n)]


# ---------------------------------------------------------------- arrivals
def arrival_times(n: int, rate: float, seed: int = 0) -> list[float]:
    """Send offsets (seconds from the start) of n requests arriving as a Poisson process of ``rate`` per
    second (exponential gaps; the first at 0); rate inf: all at once."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- one request
def request_body(model: str, item: Item, sampling: Sampling) -> tuple[str, dict[str, Any]]:
    """The route and JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": item.output_len or sampling.max_tokens,
        "temperature": sampling.temperature,
        "ignore_eos": sampling.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if item.seed is not None:
        body["seed"] = item.seed
    if item.messages is not None:
        return "/v1/chat/completions", {**body, "messages": item.messages}
    return "/v1/completions", {**body, "prompt": item.prompt}


def _content(obj: dict[str, Any]) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, url: str, model: str, item: Item, sampling: Sampling) -> RequestResult:
    """Stream one request; times from its submission, token counts from the usage chunk."""
    route, body = request_body(model, item, sampling)
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", url + route, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("error"):
                    res.error = f"stream error: {obj['error'].get('message', '')[:200]}"
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                if _content(obj):
                    res.chunk_times.append(time.perf_counter() - t0)
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2el = time.perf_counter() - t0
    res.ttft = res.chunk_times[0] if res.chunk_times else res.e2el
    res.ok = True
    return res


# ---------------------------------------------------------------- runs
def _client(connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)


async def run_closed_loop(
    url: str, model: str, items: Sequence[Item], sampling: Sampling, concurrency: int
) -> tuple[list[RequestResult], float]:
    """``concurrency`` clients, each sending its next request when its last one ends; (results, wall seconds)."""
    queue = list(reversed(items))
    results: list[RequestResult] = []
    async with _client(max(concurrency, 1)) as client:

        async def worker() -> None:
            while queue:
                results.append(await send(client, url, model, queue.pop(), sampling))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        return results, time.perf_counter() - t0


async def run_open_loop(
    url: str, model: str, items: Sequence[Item], sampling: Sampling, rate: float, seed: int = 0
) -> tuple[list[RequestResult], float]:
    """Requests sent at Poisson arrival times of ``rate`` per second whatever is in flight; (results, wall s)."""
    offsets = arrival_times(len(items), rate, seed)
    async with _client(len(items)) as client:
        t0 = time.perf_counter()
        tasks = []
        for off, item in zip(offsets, items):
            await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
            tasks.append(asyncio.create_task(send(client, url, model, item, sampling)))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - t0


async def warm_up(url: str, model: str, item: Item, sampling: Sampling) -> None:
    """One request of the run's length (as ``vllm bench serve`` runs its first prompt), so that the first measured
    one pays no one-time start-up: lazy initialisation, the KV cache grown to the run's sequence length."""
    async with _client(1) as client:
        r = await send(client, url, model, item, sampling)
    if not r.ok:
        raise RuntimeError(f"warm-up request to {url} failed: {r.error}")


# ---------------------------------------------------------------- /metrics
_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Series:
    """Prometheus text -> {(series name, labels other than model_name): value}."""
    out: Series = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = tuple(sorted((k, v) for k, v in _LABEL.findall(m.group(2) or "") if k != "model_name"))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(url: str) -> Series:
    r = httpx.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)

"""llama.cpp as ``tools/bench_int8.py``'s peer: the same prompts, as token ids rendered by the checkpoint's own
tokenizer and chat template, decoded greedily from a GGUF file of the same model (e.g. its q8_0 conversion) through
llama-cpp-python, an optional package imported only here."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

from engine.core.chat import ChatTemplate
from engine.core.errors import EngineError
from engine.core.tokenizer import Tokenizer


class PeerUnavailableError(EngineError, RuntimeError):
    """llama-cpp-python is missing or cannot read the GGUF file."""


def prompt_ids(model_dir: str | Path, prompts: tuple[str, ...]) -> list[list[int]]:
    """The prompts as the engine's ``chat_prompt`` renders them (one user message each), or as plain text
    where the checkpoint has no chat template."""
    tok = Tokenizer(model_dir)
    template = ChatTemplate.from_dir(model_dir)
    if template is None:
        return [tok.encode(p) for p in prompts]
    return [tok.encode(template.render([{"role": "user", "content": p}]), add_special_tokens=False) for p in prompts]


def _threads() -> int:
    """llama.cpp's threads: OMP_NUM_THREADS where set (as the engine's modes run), else every core."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else os.cpu_count() or 1


def peer_child(model_dir: str | Path, gguf: Path, prompts: tuple[str, ...], max_new: int) -> dict[str, Any]:
    """One round of the ``gguf`` mode in this process: tokens/s over the prompts (prefill included, as the
    engine's modes count it), the file's bytes as its weights (llama.cpp maps it), max RSS and the tokens."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise PeerUnavailableError(
            "--gguf needs llama-cpp-python: pip install llama-cpp-python (it builds llama.cpp from source)"
        ) from None
    ids = prompt_ids(model_dir, prompts)
    try:
        llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=_threads(), seed=0, verbose=False)
    except ValueError as e:
        raise PeerUnavailableError(f"--gguf {gguf}: llama.cpp cannot load it ({e})") from None
    eos = llm.token_eos()

    def run(p: list[int]) -> list[int]:
        llm.reset()
        out: list[int] = []
        for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if t == eos:
                break
            out.append(t)
            if len(out) == max_new:
                break
        return out

    run(ids[0])  # warm-up, as the engine's modes
    n, t0, outs = 0, time.perf_counter(), []
    for p in ids:
        outs.append(run(p))
        n += len(outs[-1])
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": "gguf", "tok_s": n / dt, "weight_bytes": gguf.stat().st_size, "max_rss": rss, "tokens": outs}

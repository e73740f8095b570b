"""Access control of the server, live on 127.0.0.1: the API key (``Authorization: Bearer``, the official openai
client), /health and /metrics open or protected, CORS off unless asked for, and specmix-serve's flags
(``--api-key`` or SPECMIX_API_KEY, the request limits)."""

from __future__ import annotations

import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from test_openai_server import Live  # noqa: E402

from engine import Engine  # noqa: E402
from engine.cli import serve  # noqa: E402
from engine.core.errors import InvalidConfigError  # noqa: E402
from engine.server.options import AccessOptions, RequestLimits  # noqa: E402

KEY = "sk-specmix-test"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def eng(ckpt_dir):
    return Engine.from_pretrained(ckpt_dir)


@pytest.fixture(scope="module")
def keyed(eng):
    srv = Live(eng, access=AccessOptions(api_key=KEY), api_key=KEY)
    yield srv
    srv.close()


def _error(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_the_api_key_is_required_on_v1_and_health_metrics_stay_open(keyed):
    out = keyed.client.completions.create(model="m", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2
    assert [m.id for m in keyed.client.models.list().data] == ["m"]
    for key in ("wrong", KEY + "x", KEY[:-1]):
        other = openai.OpenAI(base_url=keyed.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            other.completions.create(model="m", prompt="x", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(keyed.url + path, content=b"{not even json")  # refused before the body is read
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert _error(r)["code"] == "invalid_api_key" and "missing API key" in _error(r)["message"]
    for headers in ({"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY} x"}):
        assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == 401
    assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(keyed.url + "/openapi.json").status_code == 401
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    assert "specmix:" in httpx.get(keyed.url + "/metrics").text
    assert "access-control-allow-origin" not in httpx.get(keyed.url + "/health", headers={"Origin": ORIGIN}).headers
    r = httpx.options(
        keyed.url + "/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    assert r.status_code in (401, 405) and "access-control-allow-origin" not in r.headers  # CORS is off


def test_health_and_metrics_protected_and_cors_when_asked(eng):
    access = AccessOptions(api_key=KEY, protect_health_metrics=True, allowed_origins=(ORIGIN,))
    srv = Live(eng, access=access, api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for path in ("/health", "/metrics"):
            r = httpx.get(srv.url + path)
            assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
            assert httpx.get(srv.url + path, headers=auth).status_code == 200
        pre = {
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        r = httpx.options(srv.url + "/v1/completions", headers=pre)  # a preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = httpx.options(srv.url + "/v1/completions", headers=dict(pre, Origin="https://evil.example"))
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        assert _error(r)["code"] == "cors_refused" and ORIGIN in _error(r)["message"]
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=dict(auth, Origin=ORIGIN)
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # the browser can read why
    finally:
        srv.close()


def test_access_options_refuse_what_cannot_work():
    for bad in ("", "has space", "tab\tkey", "ключ"):
        with pytest.raises(InvalidConfigError, match="api_key"):
            AccessOptions(api_key=bad)
    with pytest.raises(InvalidConfigError, match="allowed_origins"):
        AccessOptions(allowed_origins=["*"])  # a tuple
    with pytest.raises(InvalidConfigError, match="max_n"):
        RequestLimits(max_n=0)
    assert not AccessOptions().needs_key("/v1/completions")
    assert AccessOptions(api_key="k").needs_key("/v1/models") and not AccessOptions(api_key="k").needs_key("/health")


# ---------------------------------------------------------------- specmix-serve
def test_serve_flags_and_the_key_from_the_environment(monkeypatch):
    args = serve.build_parser().parse_args(["--target", "x"])
    monkeypatch.delenv("SPECMIX_API_KEY", raising=False)
    access, limits = serve.http_options(args)
    assert access == AccessOptions() and limits == RequestLimits()
    monkeypatch.setenv("SPECMIX_API_KEY", "from-env")
    assert serve.http_options(args)[0].api_key == "from-env"  # read when the options are built, not at import
    argv = ["--target", "x", "--api-key", "flag", "--protect-health-metrics", "--allowed-origins", ORIGIN, "*"]
    argv += ["--max-body-bytes", "1000", "--max-prompts", "2", "--max-n", "3", "--max-stop", "1"]
    argv += ["--max-stop-chars", "5", "--max-stop-token-ids", "7"]
    access, limits = serve.http_options(serve.build_parser().parse_args(argv))
    assert access == AccessOptions(api_key="flag", protect_health_metrics=True, allowed_origins=(ORIGIN, "*"))
    assert limits == RequestLimits(1000, 2, 3, 1, 5, 7)


def test_specmix_serve_serves_with_the_key(eng, monkeypatch):
    """main() builds the app with the access options and the limits: the app it would run answers 401 without
    the key from SPECMIX_API_KEY and 413 beyond --max-body-bytes."""
    apps = []
    monkeypatch.setattr(serve, "load", lambda args: (eng, "m", None))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    monkeypatch.setenv("SPECMIX_API_KEY", KEY)
    assert serve.main(["--target", "x", "--max-body-bytes", "100"]) == 0
    server = uvicorn.Server(uvicorn.Config(apps[0], host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < end and thread.is_alive()
            time.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(url + "/v1/completions", json={"prompt": "x" * 200}, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth)
        assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
    monkeypatch.setenv("SPECMIX_API_KEY", "")
    assert serve.main(["--target", "x", "--max-n", "0"]) == 2  # an invalid limit: refused before loading


def test_the_ray_serve_app_takes_the_same_key(monkeypatch):
    """RayServeOptions.api_key (or SPECMIX_API_KEY where the options are built from args) reaches each replica,
    which serves create_app with it; the key never shows in the options' repr."""
    ray_serve = pytest.importorskip("engine.cli.ray_serve", exc_type=ImportError)
    monkeypatch.delenv("SPECMIX_API_KEY", raising=False)
    assert ray_serve.RayServeOptions.from_args({"profile": "p.json"}).api_key is None
    monkeypatch.setenv("SPECMIX_API_KEY", KEY)
    opts = ray_serve.RayServeOptions.from_args({"profile": "p.json"})
    assert opts.api_key == KEY and ray_serve.replica_args(opts)["api_key"] == KEY and KEY not in repr(opts)
    assert ray_serve.RayServeOptions.from_args({"profile": "p.json", "api_key": "other"}).api_key == "other"
    with pytest.raises(InvalidConfigError, match="api_key"):
        ray_serve.RayServeOptions(profile="p.json", api_key="has space")

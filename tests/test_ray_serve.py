"""specmix replicas on Ray Serve (engine/cli/ray_serve.py): a local Ray instance (2 CPUs), Serve's HTTP proxy
on 127.0.0.1, the official openai client. One profile of the test pair, built once; the cases share a
deployment and run in file order (spread, fault, drain idle and beside CPU burners, autoscale), then the
weight-mismatch case, then the options' checks. The proxy's request timeout and the replicas' drain timeout
are the ones the deployment's options derive (engine/cli/ray_drain.py), as in a real deployment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from engine import Engine, SamplingParams  # noqa: E402
from engine.api.options import Limits  # noqa: E402
from engine.cli.ray_drain import Timeouts  # noqa: E402
from engine.cli.ray_serve import REPLICA_HEADER, RayServeOptions, build_app, timeouts  # noqa: E402

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
APP = "two"
N, MAX_TOKENS = 32, 24
PROMPTS = [f"{i} The quick brown fox" for i in range(N)]
# what the openai client retries: Serve's proxy answers 500 for a request on a replica that died, and 408 after
# request_timeout_s for one its router held when the replica died (without the timeout that one would hang)
RETRYABLE = (408, 500, 502, 503, 504)
# the test pair's rounds take milliseconds (tens of them beside the CPU burners): 0.1 s is a bound with room
ROUND_S, MAX_SEQ_LEN, MAX_QUEUED = 0.1, 256, 64  # 64: the drain case queues 48 requests at the proxy


def _args(profile: Path, **kw) -> dict:
    base = {
        "profile": str(profile),
        "served_model_name": "m",
        "max_batch": 4,
        "max_queued": MAX_QUEUED,
        "max_seq_len": MAX_SEQ_LEN,
        "round_s": ROUND_S,
        "num_cpus": 0.5,
        "metrics_period_s": 0.5,
        "health_check_period_s": 1,
    }
    return {**base, **kw}


LIMITS = timeouts(RayServeOptions.from_args(_args(Path("pair.json"))))
REQUEST_TIMEOUT = LIMITS.proxy_s  # the proxy's request_timeout_s: (16 + 2) * 256 * 0.1 s
TIMEOUT = REQUEST_TIMEOUT + 30  # a client waits for the proxy's answer
# the fault case's own bound, sent as Serve's per-request timeout header: its N requests of at most 16 + MAX_TOKENS
# tokens, all queued at once (the proxy's bound is for requests of max_seq_len tokens behind a full queue)
FAULT_TIMEOUT = Timeouts.of(max_seq_len=16 + MAX_TOKENS, round_s=ROUND_S, max_batch=4, max_queued=N, proxies=1).proxy_s
TIMEOUT_HEADER = "x-request-timeout-seconds"


def _wait(cond, what: str, limit: float = 180.0, period: float = 0.5):
    end = time.monotonic() + limit
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < end, f"{what}: not within {limit:g} s"
        time.sleep(period)


@pytest.fixture(scope="module")
def profile(ckpt_dir, draft_dir, tmp_path_factory) -> Path:
    """A CPU profile of the test pair (the real build: gate + calibration, on small texts)."""
    from util import TEXT

    from engine.cli.build_profile import main

    d = tmp_path_factory.mktemp("rayprof")
    (d / "eval.txt").write_text(TEXT * 20, encoding="utf-8")
    (d / "calib.txt").write_text("Calibration text about foxes and dogs. " * 200, encoding="utf-8")
    out = d / "pair.json"
    assert (
        main(
            [
                "--gpu",
                "a100",
                "--target",
                str(ckpt_dir),
                "--draft",
                str(draft_dir),
                "--eval-text",
                str(d / "eval.txt"),
                "--calib-text",
                str(d / "calib.txt"),
                "--max-eval-tokens",
                "256",
                "--out",
                str(out),
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    return out


class Solo:
    """Each prompt's greedy completion, run alone (a batch of one) in this process."""

    def __init__(self, profile: Path) -> None:
        self.eng, self.cache = Engine.from_profile(profile, limits=Limits(max_batch=1)), {}

    def __call__(self, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        if (prompt, max_tokens) not in self.cache:
            out = self.eng.generate(prompt, SamplingParams(max_new_tokens=max_tokens))[0]
            self.cache[prompt, max_tokens] = out.text
        return self.cache[prompt, max_tokens]


@pytest.fixture(scope="module")
def solo(profile) -> Solo:
    return Solo(profile)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance whose workers import this checkout; Serve's proxy on a free loopback port."""
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a throwaway loopback cluster
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        _system_config={"metrics_report_interval_ms": 1000},
    )
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": REQUEST_TIMEOUT})
    node = ray._private.worker._global_node
    yield {"port": port, "session": Path(node.get_session_dir_path()), "metrics_port": node.metrics_export_port}
    serve.shutdown()
    ray.shutdown()
    if old is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = old


def _replicas(app: str) -> dict[str, int]:
    return dict(serve.status().applications[app].deployments["specmix"].replica_states)


@pytest.fixture(scope="module")
def two(cluster, profile):
    serve.run(build_app(_args(profile, min_replicas=2, max_replicas=2)), name=APP, route_prefix="/")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{cluster['port']}/v1", api_key="none", max_retries=0, timeout=TIMEOUT
    )
    yield client
    serve.delete(APP)


def _complete(client, prompt: str, max_tokens: int = MAX_TOKENS, timeout_s: float | None = None) -> tuple[str, str]:
    """The replica that answered and the completion; ``timeout_s``: Serve's per-request timeout, not the proxy's."""
    headers = {} if timeout_s is None else {TIMEOUT_HEADER: f"{timeout_s:g}"}
    r = client.completions.with_raw_response.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_headers=headers
    )
    return r.headers[REPLICA_HEADER], r.parse().choices[0].text


def _try(
    client, prompt: str, max_tokens: int = MAX_TOKENS, timeout_s: float | None = None
) -> tuple[str, str] | openai.APIError:
    try:
        return _complete(client, prompt, max_tokens, timeout_s)
    except openai.APIError as e:
        return e


def _metric(cluster, name: str) -> dict[str, float]:
    """replica id -> value of a Serve metric, scraped from Ray's Prometheus endpoint."""
    text = httpx.get(f"http://127.0.0.1:{cluster['metrics_port']}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(f"ray_{name}{{"):
            rep = line.split('replica="', 1)[1].split('"', 1)[0]
            out[rep] = float(line.rsplit(" ", 1)[1])
    return out


def test_two_replicas_spread_equal_solo_and_metrics(cluster, two, solo):
    with ThreadPoolExecutor(N) as ex:
        got = list(ex.map(lambda p: _complete(two, p), PROMPTS))
    served = Counter(rep for rep, _ in got)
    assert len(served) == 2, served  # both replicas served
    for p, (_, text) in zip(PROMPTS, got):
        assert text == solo(p), p
    # every serving replica reports its acceptance and speedup through Serve's metrics (replica tag)
    acc = _wait(
        lambda: (
            (v := _metric(cluster, "specmix_spec_decode_draft_acceptance_rate"))
            and all(v.get(r, 0) > 0 for r in served)
            and v
        ),
        "acceptance gauges of both replicas",
        60,
    )
    tpp = _metric(cluster, "specmix_tokens_per_sequence_round")
    gen = _metric(cluster, "specmix_generation_tokens_total") or _metric(cluster, "specmix_generation_tokens")
    for r in served:
        assert 0 < acc[r] <= 1 and tpp[r] > 1  # the drafter's tokens are accepted: more than one token per pass
        assert gen[r] >= served[r]  # at least a token per request it served
    assert httpx.get(f"http://127.0.0.1:{cluster['port']}/health", timeout=30).json() == {"status": "ok"}
    st = serve.get_deployment_handle("specmix", app_name=APP).stats.remote().result(timeout_s=60)
    assert st["replica"] in served and st["engine"]["requests"] >= served[st["replica"]]  # a replica's own view
    assert st["metrics"]["specmix_spec_decode_draft_acceptance_rate"] == st["engine"]["acceptance_rate"]


def test_killed_replica_restarts_and_no_request_is_lost(cluster, two, solo):
    """A replica killed mid-load: each request completes or gets a retryable error (the held ones a 408 after the
    per-request timeout the client sent, bounded for these requests), never hangs; Serve restarts the replica."""
    with ThreadPoolExecutor(N) as ex:
        futs = [ex.submit(_try, two, p, MAX_TOKENS, FAULT_TIMEOUT) for p in PROMPTS]
        first = _wait(lambda: next((f.result() for f in futs if f.done()), None), "a first answer", TIMEOUT, 0.02)
        assert not isinstance(first, openai.APIError), first
        victim = first[0]
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#specmix#{victim}", namespace="serve"))
        results = [f.result() for f in futs]
    ok = {p: r for p, r in zip(PROMPTS, results) if not isinstance(r, openai.APIError)}
    failed = {p: r for p, r in zip(PROMPTS, results) if isinstance(r, openai.APIError)}
    assert len(ok) + len(failed) == N  # one outcome per request
    for p, e in failed.items():  # an HTTP error the client may retry (it retries >= 500 by default), never a hang
        assert isinstance(e, openai.APIStatusError) and e.status_code in RETRYABLE, (p, e)
    for p, (_, text) in ok.items():  # what completed is the right answer, not another request's
        assert text == solo(p), p
    assert failed, "the killed replica had requests in flight"
    _wait(lambda: _replicas(APP).get("RUNNING") == 2, "Serve restarts the killed replica")
    retried = {p: _complete(two, p) for p in failed}
    assert all(text == solo(p) for p, (_, text) in retried.items())
    assert victim not in {rep for rep, _ in retried.values()}
    reps: set[str] = set()

    def load_both() -> bool:  # 16 clients queue more than one replica's max_batch: the router uses both
        with ThreadPoolExecutor(16) as ex:
            reps.update(rep for rep, _ in ex.map(lambda p: _complete(two, p), PROMPTS))
        return len(reps) == 2

    _wait(load_both, "the restarted replica serves too", 120)
    assert victim not in reps
    codes = Counter(e.status_code for e in failed.values())
    print(f"kill mid-load: {len(ok)} completed, retryable HTTP errors {dict(codes)}, all retried ok")


def _live(app: str) -> set[str]:
    """The ids of the app's replica actors alive now."""
    pre = f"SERVE_REPLICA::{app}#specmix#"
    return {a["name"][len(pre) :] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(pre)}


@contextmanager
def cpu_burners(n: int, limit_s: float) -> Iterator[list[subprocess.Popen]]:
    """``n`` processes that spin on the CPU for at most ``limit_s`` seconds each (ended on exit)."""
    code = f"import time\nend = time.monotonic() + {limit_s}\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("burners", "long"), [(0, 200), (2, 100)], ids=["idle", "beside-2-cpu-burners"])
def test_scale_down_drains_running_requests(cluster, two, solo, profile, burners, long):
    """2 -> 1 replicas while both decode: the stopped replica finishes what it runs (graceful shutdown).
    64 requests on 2 replicas of max_batch 4 run in eight waves (the running metric lags the replicas by a
    scrape, in which fast replicas finish waves); the scale-down comes with at least two waves still to run. Beside two
    processes spinning on the 2 CPUs every round is slower, and no request is lost either: the timeouts
    follow the longest request (max_seq_len rounds of round_s), not the machine's speed. The burners run until
    the stopped replicas have drained (the start of the new config's replica beside them is not under test). Idle,
    the requests are long (200 tokens of the tiny pair's context of 256) so that the scrape's lag leaves two waves;
    beside the burners a wave of 100 tokens takes many scrapes."""
    prompts = PROMPTS * 2
    for p in prompts:
        solo(p, long)
    if _replicas(APP) != {"RUNNING": 2}:  # (a serve.run restarts every replica: only when needed)
        serve.run(build_app(_args(profile, min_replicas=2, max_replicas=2)), name=APP, route_prefix="/")
        _wait(lambda: _replicas(APP) == {"RUNNING": 2}, "two replicas")
    with ThreadPoolExecutor(len(prompts) + 1) as ex:
        with cpu_burners(burners, TIMEOUT) as load:
            futs = [ex.submit(_try, two, p, long) for p in prompts]
            live = _live(APP)
            _wait(
                lambda: (
                    all(_metric(cluster, "specmix_num_requests_running").get(r, 0) > 0 for r in live)
                    or sum(f.done() for f in futs) >= len(futs) // 2
                ),
                "both replicas decode",
                60,
                0.2,
            )
            left = len(futs) - sum(f.done() for f in futs)
            assert left >= 2 * 2 * 4, f"only {left} requests were left at the scale-down: not two waves of 2 x 4"
            new_config = build_app(_args(profile, min_replicas=1, max_replicas=1))
            scaled = ex.submit(serve.run, new_config, name=APP, route_prefix="/")
            # the new config replaces both replicas: each drains what it runs, then its actor exits
            _wait(lambda: not live & _live(APP), "the stopped replicas drain", TIMEOUT)
            assert all(p.poll() is None for p in load), "a CPU burner ended before the stopped replicas drained"
        scaled.result()  # the replica Serve starts for the new config (after the burners: not under test)
        results = [f.result() for f in futs]
    errors = [r for r in results if isinstance(r, openai.APIError)]
    assert not errors, errors
    # both replicas that were decoding answered: the stopped one drained what it ran (the queued rest may go to
    # a replica Serve starts for the new config)
    assert live <= {rep for rep, _ in results}
    assert all(text == solo(p, long) for p, (_, text) in zip(prompts, results))
    _wait(lambda: _replicas(APP) == {"RUNNING": 1}, "one replica left")


def test_autoscale_up_under_load_and_down_when_idle(cluster, two, solo, profile):
    """1 replica, ongoing-requests target = max_batch (4): 16 clients drive it to 2, idling brings it back."""
    serve.run(
        build_app(
            _args(
                profile,
                min_replicas=1,
                max_replicas=2,
                initial_replicas=1,
                upscale_delay_s=1,
                downscale_delay_s=3,
                look_back_period_s=1,
            )
        ),
        name=APP,
        route_prefix="/",
    )
    _wait(lambda: _replicas(APP) == {"RUNNING": 1}, "one replica")  # (one may still be stopping)
    stop, seen = [], Counter()

    def client_loop(k: int) -> list:
        out = []
        while not stop:
            p = PROMPTS[(k + 16 * len(out)) % N]
            out.append((p, _try(two, p)))
        return out

    with ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(client_loop, k) for k in range(16)]
        try:
            _wait(lambda: _replicas(APP).get("RUNNING") == 2, "scale-up to 2 replicas under load", 120)
        finally:
            stop.append(True)
        results = [x for f in futs for x in f.result()]
    for p, r in results:
        assert not isinstance(r, openai.APIError), r
        assert r[1] == solo(p)
        seen[r[0]] += 1
    _wait(lambda: _replicas(APP) == {"RUNNING": 1}, "scale-down to 1 replica when idle", 120)
    print(f"autoscale: {len(results)} requests over replicas {dict(seen)}")


def test_replica_with_other_weights_refuses_to_start(cluster, profile, tmp_path):
    """The profile pins the weights' sha256: a worker whose weights differ fails its start, ProfileError in its log."""
    from safetensors.torch import load_file, save_file

    prof = json.loads(profile.read_text(encoding="utf-8"))
    for role in ("target", "draft"):
        shutil.copytree(prof["models"][role]["path"], tmp_path / role)
        prof["models"][role]["path"] = str(tmp_path / role)
    f = next((tmp_path / "target").glob("*.safetensors"))
    w = load_file(f)
    name = next(iter(w))
    w[name] = w[name] + 1e-3  # other weights at the profile's path
    save_file(w, f, metadata={"format": "pt"})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(prof), encoding="utf-8")
    try:
        with pytest.raises(RuntimeError) as err:  # serve.run waits for the app: it fails after Serve's retries
            serve.run(build_app(_args(bad)), name="bad", route_prefix="/bad")
        assert "Deploying application bad failed" in str(err.value)
        st = serve.status().applications["bad"]
        msg = st.deployments["specmix"].message
        assert st.status == "DEPLOY_FAILED" and "ProfileError" in msg and "no longer matches the profile" in msg
        logs = [p.read_text(errors="replace") for p in (cluster["session"] / "logs" / "serve").glob("replica_bad_*")]
        assert logs and any("ProfileError" in t and "no longer matches the profile" in t for t in logs)
    finally:
        serve.delete("bad")


def test_options_and_the_deploy_config():
    """deploy/ray-serve.yaml is a valid Serve config whose args parse; bad args are typed errors naming the field."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from engine.cli.ray_serve import RayServeOptions, deployment_options
    from engine.core.errors import InvalidConfigError

    cfg = yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text(encoding="utf-8"))
    ServeDeploySchema.model_validate(cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "engine.cli.ray_serve:build_app"
    opts = RayServeOptions.from_args(app["args"])
    gpu = deployment_options(opts, "cuda")
    assert gpu["ray_actor_options"]["num_gpus"] == 1 and gpu["autoscaling_config"]["target_ongoing_requests"] == 64
    assert deployment_options(opts, "cpu")["ray_actor_options"]["num_gpus"] == 0
    assert RayServeOptions.from_args({"profile": "p.json", "max_batch": "8", "full_check": "true"}).max_batch == 8
    for args, field in (
        ({"profile": "p.json", "max_batch": "0"}, "max_batch"),
        ({"max_batch": 4}, "profile"),
        ({"profile": "p", "replicas": 2}, "replicas"),
        ({"profile": "p", "stall_s": "x"}, "stall_s"),
        ({"profile": "p", "min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ):
        with pytest.raises(InvalidConfigError, match=field):
            RayServeOptions.from_args(args)


def test_timeouts_follow_the_longest_request():
    """Serve's drain and the proxy's request timeout are derived from max_seq_len rounds of round_s and what may
    wait ahead (engine/cli/ray_drain.py), never fixed; deploy/ray-serve.yaml's proxy timeout covers its args."""
    import yaml

    from engine.cli.ray_drain import Timeouts
    from engine.cli.ray_serve import deployment_options
    from engine.core.errors import InvalidConfigError

    t = Timeouts.of(max_seq_len=100, round_s=0.5, max_batch=4, max_queued=10, proxies=2)
    assert (t.request_s, t.drain_s, t.proxy_s) == (50, 100, (5 + 2) * 50)  # ceil(2 * 10 / 4) waves ahead
    base = RayServeOptions(profile="p.json", max_batch=4, max_queued=10, max_seq_len=100, round_s=0.5)
    slower = timeouts(dataclasses.replace(base, round_s=1.0))
    assert (slower.drain_s, slower.proxy_s) == (2 * timeouts(base).drain_s, 2 * timeouts(base).proxy_s)
    opts = deployment_options(base, "cpu")
    assert opts["graceful_shutdown_timeout_s"] == timeouts(base).drain_s and opts["max_queued_requests"] == 10
    assert opts["max_ongoing_requests"] == 8  # what drain_s counts: a running batch and as many waiting
    unset = dataclasses.replace(base, max_seq_len=None)
    assert timeouts(unset, context=512).request_s == 512 * 0.5  # the target's context
    for make, field in (
        (lambda: timeouts(unset), "max_seq_len"),
        (lambda: timeouts(base, context=64), "max_seq_len=100"),
        (lambda: RayServeOptions(profile="p", round_s=200.0), "round_s=200.0 is invalid with stall_s=120.0"),
        (lambda: RayServeOptions.from_args({"profile": "p", "graceful_shutdown_timeout_s": 60}), "unknown"),
        (lambda: RayServeOptions.from_args({"profile": "p", "max_queued": "0"}), "max_queued"),
    ):
        with pytest.raises(InvalidConfigError, match=field):
            make()
    cfg = yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text(encoding="utf-8"))
    yaml_opts = RayServeOptions.from_args(cfg["applications"][0]["args"])
    assert cfg["http_options"]["request_timeout_s"] >= timeouts(yaml_opts).proxy_s


def test_replica_warns_when_its_rounds_are_slower_than_round_s(caplog):
    """The replica's check of round_s: its mean busy seconds per round over each metrics period."""
    from engine.cli.ray_drain import SlowRounds

    watch = SlowRounds(0.1, "r1", every_s=3600)
    logger = logging.getLogger("ray.serve.specmix")  # Ray's "ray.serve" logger does not propagate to the root
    logger.addHandler(caplog.handler)
    try:
        assert watch.check({}) is None  # no round yet
        assert watch.check({"specmix_busy_seconds": 1.0, "specmix_rounds": 20}) == pytest.approx(0.05)
        assert not caplog.records
        assert watch.check({"specmix_busy_seconds": 4.0, "specmix_rounds": 30}) == pytest.approx(0.3)
        assert watch.check({"specmix_busy_seconds": 7.0, "specmix_rounds": 40}) == pytest.approx(0.3)
    finally:
        logger.removeHandler(caplog.handler)
    (rec,) = [r for r in caplog.records if r.levelno == logging.WARNING]  # once per every_s
    assert "replica r1" in rec.message and "above round_s=0.1" in rec.message and "raise round_s" in rec.message

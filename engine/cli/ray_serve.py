"""specmix on Ray Serve: one Engine per replica behind the OpenAI-compatible app (``pip install 'specmix[ray]'``).

    serve run deploy/ray-serve.yaml
    serve run engine.cli.ray_serve:build_app profile=profiles/a100-demo.json max_replicas=4

Each replica builds ``Engine.from_profile`` (the profile pins the sha256 of every weight file: a
replica whose weights differ fails its start with the ProfileError in its log) and serves the same
FastAPI app as ``specmix-serve`` (engine/server/openai_app.py) through ``@serve.ingress``; every
response carries the replica's id in the ``x-specmix-replica`` header. A CUDA profile takes one GPU
per replica, a CPU profile ``num_cpus`` cores. Autoscaling follows ongoing requests per replica with
the target ``max_batch`` (a full batch; ``max_ongoing_requests`` is two batches, the rest wait at
Serve's router, where a new replica can take them, up to ``max_queued`` per proxy). Health checks ask the
engine (``check_health``: a stalled or repeatedly failing decode round restarts the replica); on scale-down
or a restart Serve stops routing to the replica and waits for what it holds to finish. The timeouts, Serve's
``graceful_shutdown_timeout_s`` and the proxy's ``request_timeout_s``, are derived from the longest request
a replica may hold (``Timeouts``: ``max_seq_len`` rounds of at most ``round_s`` seconds, times what waits
ahead), never fixed. Replicas report the engine's metrics (acceptance, tokens, load) as Serve metrics
(engine/server/ray_metrics.py) and warn when their measured rounds are slower than ``round_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve import Application

from engine.cli.ray_drain import SlowRounds, Timeouts, sequence_bound
from engine.core.errors import EngineError, InvalidConfigError
from engine.server.options import AccessOptions

log = logging.getLogger("ray.serve.specmix")  # under ray.serve: Serve writes it to the replica's log
REPLICA_HEADER = "x-specmix-replica"


@dataclass(frozen=True)
class RayServeOptions:
    """The application's arguments (``args:`` of a ``serve run`` config, or ``key=value`` on its command line)."""

    profile: str
    """The profile file, readable at this path on every worker (it names the weights and pins their hashes)."""
    served_model_name: str | None = None
    """The model name clients send (default: the profile's file name without .json)."""
    device: str | None = None
    """Override the profile's device ("cpu" or "cuda"; default: the profile's)."""
    max_batch: int = 64
    """Sequences each replica decodes at once; also the autoscaling target (ongoing requests per replica)."""
    max_waiting: int = 256
    """Requests waiting in a replica's engine beyond its batch (Serve's router queues the rest)."""
    max_queued: int = 256
    """Requests each Serve proxy queues for the deployment beyond what its replicas hold (Serve's
    ``max_queued_requests``); past it the proxy answers 503 at once (clients retry)."""
    max_seq_len: int | None = None
    """The longest sequence (prompt + completion) a replica accepts; a longer request is a 400 (default: the
    target's context, from the profile). With ``round_s`` it bounds the longest request (``Timeouts``)."""
    round_s: float = 0.5
    """The slowest a decoding round of a full batch may be, in seconds (the target pass with its drafts and
    the prefill of requests that join it): the drain and request timeouts are derived from it (``Timeouts``).
    A replica whose measured rounds are slower logs a warning (raise it)."""
    proxies: int = 1
    """Serve proxies that route to the deployment (one per node with ``proxy_location: EveryNode``): the
    request timeout counts what every proxy may queue ahead of a request."""
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    """Window over which Serve averages the ongoing requests it scales on."""
    num_cpus: float | None = None
    """CPUs per replica (default 1; on a CPU profile torch uses that many threads)."""
    num_gpus: float | None = None
    """GPUs per replica (default: 1 for a CUDA profile, 0 for a CPU one)."""
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    stall_s: float = 120.0
    """A decode round running longer than this makes the replica unhealthy (Serve restarts it); >= round_s."""
    metrics_period_s: float = 5.0
    """How often a replica updates its Serve metrics."""
    full_check: bool = False
    """Re-hash every weight file at start (default: only files whose size/mtime/inode changed)."""
    api_key: str | None = field(default=None, repr=False)
    """Clients must send ``Authorization: Bearer <api_key>`` on /v1/* (default: $SPECMIX_API_KEY where the
    options are built from args; unset: no key). /health and /metrics stay open (docs/design.md, section 12)."""

    def __post_init__(self) -> None:
        if not isinstance(self.profile, str) or not self.profile:
            raise InvalidConfigError(f"profile={self.profile!r} is invalid: allowed the path of a profile file")
        if self.device not in (None, "cpu", "cuda"):
            raise InvalidConfigError(f"device={self.device!r} is invalid: allowed cpu, cuda or None")
        for name in ("max_batch", "max_waiting", "max_queued", "max_replicas", "proxies"):
            if getattr(self, name) < 1:
                raise InvalidConfigError(f"{name}={getattr(self, name)!r} is invalid: allowed an int >= 1")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise InvalidConfigError(
                f"min_replicas={self.min_replicas} is invalid: allowed 0..max_replicas ({self.max_replicas})"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise InvalidConfigError(
                f"initial_replicas={self.initial_replicas} is invalid: allowed "
                f"min_replicas..max_replicas ({self.min_replicas}..{self.max_replicas})"
            )
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(v, (int, float)) and v > 0):
                raise InvalidConfigError(f"{f.name}={v!r} is invalid: allowed a number of seconds > 0")
        for name in ("num_cpus", "num_gpus"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise InvalidConfigError(f"{name}={v!r} is invalid: allowed a number >= 0 or None")
        if self.max_seq_len is not None and not (isinstance(self.max_seq_len, int) and self.max_seq_len >= 2):
            raise InvalidConfigError(f"max_seq_len={self.max_seq_len!r} is invalid: allowed an int >= 2 or None")
        AccessOptions(api_key=self.api_key)  # refuses a key no client could send
        if self.round_s > self.stall_s:
            raise InvalidConfigError(
                f"round_s={self.round_s} is invalid with stall_s={self.stall_s}: a round that round_s allows "
                "would fail the health check; allowed round_s <= stall_s"
            )

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RayServeOptions:
        """Options from a ``serve run`` args mapping (values may be strings: ``key=value`` on the command line)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - set(fields))
        if unknown:
            raise InvalidConfigError(f"unknown argument(s) {', '.join(unknown)}: allowed {', '.join(fields)}")
        kw: dict[str, Any] = {}
        for name, v in args.items():
            kind = str(fields[name].type)
            if isinstance(v, str) and v.lower() in ("none", "null") and "None" in kind:
                v = None
            elif isinstance(v, str) and not kind.startswith("str"):
                try:
                    v = (
                        v.lower() in ("1", "true", "yes")
                        if kind == "bool"
                        else int(v)
                        if kind.startswith("int")
                        else float(v)
                    )
                except ValueError:
                    raise InvalidConfigError(f"{name}={v!r} is invalid: allowed a {kind}") from None
            kw[name] = v
        if "profile" not in kw:
            raise InvalidConfigError("profile is missing: allowed the path of a profile file")
        if kw.get("api_key") is None:
            kw["api_key"] = os.environ.get("SPECMIX_API_KEY") or None
        return cls(**kw)


REPLICA_FIELDS = (
    "profile",
    "served_model_name",
    "device",
    "max_batch",
    "max_waiting",
    "max_seq_len",
    "round_s",
    "num_cpus",
    "stall_s",
    "metrics_period_s",
    "full_check",
    "api_key",
)


def replica_args(opts: RayServeOptions) -> dict[str, Any]:
    """What a replica is built from: changing only the scaling options updates replicas in place."""
    return {k: getattr(opts, k) for k in REPLICA_FIELDS}


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that served it."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)


@serve.deployment(name="specmix")
@serve.ingress()
class SpecmixReplica:
    """One Engine (from the profile) and the OpenAI app over it."""

    async def __init__(self, args: dict[str, Any]) -> None:
        from engine.api.engine import Engine
        from engine.api.options import Limits
        from engine.server.openai_app import OpenAIServer
        from engine.server.ray_metrics import ReplicaMetrics

        self.opts = opts = RayServeOptions(**args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        limits = Limits(max_batch=opts.max_batch, max_waiting=opts.max_waiting, max_seq_len=opts.max_seq_len)
        try:
            self.engine = Engine.from_profile(
                opts.profile, device=opts.device, limits=limits, full_check=opts.full_check
            )
        except EngineError as e:
            log.error("replica %s refuses to start: %s: %s", self.replica_id, type(e).__name__, e)
            raise
        if self.engine.device.type == "cpu":
            import torch

            torch.set_num_threads(max(1, int(opts.num_cpus or 1)))
        name = opts.served_model_name or _stem(opts.profile)
        self.server = OpenAIServer(self.engine, name)
        self.metrics = ReplicaMetrics()
        self._reporter = asyncio.get_running_loop().create_task(self._report())
        log.info(
            "replica %s serves %s from %s on %s (max_batch %d)",
            self.replica_id,
            name,
            opts.profile,
            self.engine.device,
            opts.max_batch,
        )

    def __serve_build_asgi_app__(self) -> Any:
        from engine.server.openai_app import create_app

        app = create_app(self.server, AccessOptions(api_key=self.opts.api_key))
        app.add_middleware(ReplicaHeader, replica=self.replica_id)
        return app

    async def _report(self) -> None:
        rounds = SlowRounds(self.opts.round_s, self.replica_id)
        while True:
            rounds.check(self.metrics.update(self.engine.metric_samples()))
            await asyncio.sleep(self.opts.metrics_period_s)

    def check_health(self) -> None:
        """Serve's health probe: raises (and Serve restarts the replica) when the engine cannot make progress."""
        self.engine.check_health(stall_s=self.opts.stall_s)

    def stats(self) -> dict[str, Any]:
        """This replica's id, its Serve metric values and the engine's stats (through a deployment handle)."""
        return {
            "replica": self.replica_id,
            "metrics": self.metrics.update(self.engine.metric_samples()),
            "engine": {k: v for k, v in self.engine.stats().items() if k != "memory"},
        }

    def __del__(self) -> None:
        if hasattr(self, "_reporter"):
            self._reporter.cancel()
            st = self.engine.stats()
            log.info(
                "replica %s stops: %d requests finished, %d running, %d waiting",
                self.replica_id,
                st["requests"],
                st["running"],
                st["waiting"],
            )


def _stem(path: str) -> str:
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return name[:-5] if name.endswith(".json") else name


def timeouts(opts: RayServeOptions, context: int | None = None) -> Timeouts:
    """The deployment's timeouts (engine/cli/ray_drain.py); ``context``: the target's, bounding ``max_seq_len``."""
    return Timeouts.of(
        max_seq_len=sequence_bound(opts.max_seq_len, context),
        round_s=opts.round_s,
        max_batch=opts.max_batch,
        max_queued=opts.max_queued,
        proxies=opts.proxies,
    )


def deployment_options(opts: RayServeOptions, profile_device: str, context: int | None = None) -> dict[str, Any]:
    """Serve's options for the deployment: resources, autoscaling (target max_batch), health, queue and drain
    (``graceful_shutdown_timeout_s`` from ``Timeouts``; ``context``: the target's, when ``max_seq_len`` is None)."""
    cuda = (opts.device or profile_device) == "cuda"
    gpus = opts.num_gpus if opts.num_gpus is not None else (1 if cuda else 0)
    actor: dict[str, Any] = {"num_cpus": opts.num_cpus if opts.num_cpus is not None else 1, "num_gpus": gpus}
    auto = {
        "min_replicas": opts.min_replicas,
        "max_replicas": opts.max_replicas,
        "target_ongoing_requests": opts.max_batch,
        "upscale_delay_s": opts.upscale_delay_s,
        "downscale_delay_s": opts.downscale_delay_s,
        "look_back_period_s": opts.look_back_period_s,
        "metrics_interval_s": min(10.0, opts.look_back_period_s / 2),
    }  # Serve wants look-back > interval
    if opts.initial_replicas is not None:
        auto["initial_replicas"] = opts.initial_replicas
    drain_s = timeouts(opts, context).drain_s
    return {
        "ray_actor_options": actor,
        "autoscaling_config": auto,
        "max_ongoing_requests": 2 * opts.max_batch,
        "max_queued_requests": opts.max_queued,
        "health_check_period_s": opts.health_check_period_s,
        "health_check_timeout_s": opts.health_check_timeout_s,
        "graceful_shutdown_timeout_s": drain_s,
        "graceful_shutdown_wait_loop_s": min(2.0, drain_s),
    }


def build_app(args: dict[str, Any]) -> Application:
    """The Serve application (``import_path: engine.cli.ray_serve:build_app``).

    The profile is read here without its weights (the driver need not hold them) for its device and the
    target's context; each replica reads it again and checks the weights' hashes where they run. The derived
    timeouts are logged: the proxy's ``request_timeout_s`` (``http_options``) should be at least ``proxy_s``.
    """
    from engine.api.profile import load_profile

    opts = args if isinstance(args, RayServeOptions) else RayServeOptions.from_args(dict(args))
    prof = load_profile(opts.profile, check_weights=False)
    context = int(prof.models.target.config["max_position_embeddings"])
    t = timeouts(opts, context)
    log.info(
        "specmix on Serve: requests up to %d tokens at most %g s per round: a request runs <= %.0f s, a replica "
        "drains in <= %.0f s (graceful_shutdown_timeout_s); set http_options.request_timeout_s >= %.0f",
        sequence_bound(opts.max_seq_len, context),
        opts.round_s,
        t.request_s,
        t.drain_s,
        t.proxy_s,
    )
    return SpecmixReplica.options(**deployment_options(opts, prof.device, context)).bind(replica_args(opts))

"""A small HTTP service embedding specmix's Engine (standard library only).

    python examples/server.py [--profile FILE | --target DIR [--draft DIR]] [--host H] [--port N]

Default model: profiles/a100-80gb-demo.json if it exists, else the tiny demo pair
(engine.demo.demo_pair("tiny"), built on the first run).

POST /generate  JSON {"prompt": str | [int], "max_new_tokens", "temperature", "top_k", "top_p",
                      "seed", "stop": [str], "stream": bool}
                -> {"text", "token_ids", "finish_reason", "prompt_tokens", "stats"}
                with "stream": true, server-sent events: data: {"text": piece} ... then
                data: {"finish_reason", "token_ids"} and data: [DONE]
GET /metrics    Prometheus text format
GET /health     {"status": "ok"}

Bad JSON or bad parameters: 400 with the EngineError's message; a full queue: 503.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from engine import Engine, EngineError, SamplingParams
from engine.api.options import Limits
from engine.core.errors import InvalidRequestError, OverloadedError

DEFAULT_PROFILE = Path("profiles") / "a100-80gb-demo.json"  # relative to the working directory

log = logging.getLogger("specmix.server")

PARAM_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
FIELDS = ("prompt", "stream") + PARAM_FIELDS


def parse_request(body: bytes) -> tuple[Any, SamplingParams, bool]:
    """JSON body -> (prompt, params, stream); raises InvalidRequestError naming the field."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidRequestError(f"body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("body is invalid: allowed a JSON object")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}: allowed {', '.join(FIELDS)}")
    if "prompt" not in data:
        raise InvalidRequestError("prompt is missing: allowed a string or a list of token ids")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError(f"stream={stream!r} is invalid: allowed true or false")
    kw = {k: data[k] for k in PARAM_FIELDS if k in data}
    try:
        params = SamplingParams(**kw)
    except EngineError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"sampling parameters are invalid: {e}") from None
    return data["prompt"], params, stream


def make_handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "specmix-example/0.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            log.info("%s %s", self.address_string(), format % args)

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, code: int, obj: Any) -> None:
            self._send(code, json.dumps(obj).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/metrics":
                self._send(200, engine.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": f"no route GET {self.path}: allowed /metrics, /health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/generate":
                self._json(404, {"error": f"no route POST {self.path}: allowed /generate"})
                return
            try:
                n = int(self.headers.get("Content-Length") or 0)
                prompt, params, stream = parse_request(self.rfile.read(n))
                req = engine.submit(prompt, params)
            except OverloadedError as e:
                self._json(503, {"error": str(e)})
                return
            except EngineError as e:  # a bad request: the message names the field and the allowed values
                self._json(400, {"error": str(e)})
                return
            if stream:
                self._stream(req)
                return
            try:
                out = req.result()
            except EngineError as e:
                self._json(500, {"error": str(e)})
                return
            self._json(
                200,
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "stats": out.stats,
                },
            )

        def _stream(self, req: Any) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            try:
                try:
                    for piece in req:
                        self._event({"text": piece})
                    out = req.result()
                    self._event({"finish_reason": out.finish_reason, "token_ids": out.token_ids})
                except EngineError as e:
                    self._event({"error": str(e)})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                req.cancel()  # the client went away: free the slot
                log.info("client disconnected; request cancelled")

        def _event(self, obj: Any) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer serving ``engine`` (port 0: any free port; see server.server_address)."""
    srv = ThreadingHTTPServer((host, port), make_handler(engine))
    srv.daemon_threads = True
    return srv


def load_engine(args: argparse.Namespace) -> Engine:
    limits = Limits(max_batch=args.max_batch, max_waiting=args.max_waiting)
    if args.target:
        return Engine.from_pretrained(args.target, args.draft, limits=limits, device=args.device)
    profile = args.profile or DEFAULT_PROFILE  # what `python tools/build_profile.py --gpu a100` writes
    if args.profile or Path(profile).is_file():
        log.info("serving the profile %s", profile)
        return Engine.from_profile(profile, device=args.device, limits=limits)
    from engine.demo.pair import demo_pair

    log.info(
        "no profile at %s (build it: python tools/build_profile.py --gpu a100): serving the tiny demo pair, "
        "unquantized",
        profile,
    )
    target, draft = demo_pair("tiny", progress=False)
    return Engine.from_pretrained(target, draft, device=args.device, limits=limits)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--profile", help="a built profile (default: profiles/a100-80gb-demo.json if present)")
    src.add_argument("--target", help="a target checkpoint directory (HF format)")
    ap.add_argument("--draft", help="a draft checkpoint directory (with --target)")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the profile's or cpu)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-waiting", type=int, default=256)
    args = ap.parse_args(argv)
    if args.draft and not args.target:
        ap.error("--draft needs --target")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = load_engine(args)
    if engine.costs is not None:  # measure the K controller's costs now, not in the first request
        log.info("K controller costs: c=%.3f", engine.costs.c)
    srv = make_server(engine, args.host, args.port)
    host, port = srv.server_address[:2]
    log.info("serving on http://%s:%d (POST /generate, GET /metrics)", host, port)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

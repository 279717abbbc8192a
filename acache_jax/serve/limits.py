"""What one HTTP request may cost, and a shutdown that answers every client.

uvicorn bounds a request's headers (h11: `--max-header-bytes`) and closes an idle keep-alive
connection (`--keep-alive-timeout`), but it would wait forever for headers or a body that stop
arriving, read a body of any size, log a `ClientDisconnect` traceback when a client hangs up
mid-upload, and at shutdown cancel what still runs (a plain-text 500, a stream cut without
`[DONE]`). Its own exception path also bypasses the app's counting and closes the keep-alive
connection. What this module adds:

- `header_timeout_protocol`: uvicorn's HTTP protocol with a deadline for a request's headers,
  counted from their first byte (or from the connection's opening): a half-sent request line or
  header block is dropped, not held.
- `Guard`, an ASGI middleware in front of the app: it reads the whole body within a size (413) and
  a time (408) limit before the app runs, refuses new requests once the server is stopping (503),
  turns an exception the app raises into a 500 error object (or an SSE error event and `[DONE]`
  once a stream has started) so the connection's HTTP stays well formed, and counts every response
  by route and status for /metrics.
- `GracefulServer`: on SIGTERM no new request is taken; at `--shutdown-timeout` every request still
  running is answered 503 (an SSE error event and `[DONE]` for a stream) by the app itself, not
  cancelled by uvicorn, and the number cut is kept for the exit code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from acache_jax.serve.protocol import ApiError

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

POLL_S = 0.25  # how often a body read looks whether the server has started stopping
_STOPPING = (503, "the server is shutting down; retry on another instance", "shutting_down")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The limits on one request (`python -m acache_jax.serve --help` names their flags).

    A body of 2 MiB holds the longest prompt of a 128k-token context with room for JSON escapes;
    30 s for it is a client sending 70 kB/s. `header_timeout` is counted from the first byte of a
    request: an idle keep-alive connection is uvicorn's `keep_alive_timeout` to close."""

    max_body_bytes: int = 2 << 20
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_header_bytes: int = 16 << 10
    keep_alive_timeout: int = 5
    max_model_len: int | None = None  # prompt + generated tokens (None: the model's context)
    max_prompt_tokens: int | None = None  # prompt, affix and tail tokens (None: what the context leaves)


class Lifecycle:
    """What the server's shutdown has reached, shared by the middleware, the request handlers and
    the command line: `stopping` once SIGTERM came (new requests get 503), and `cut`, the accepted
    requests that were answered 503 because they were still running at the shutdown timeout."""

    def __init__(self) -> None:
        self.stopping = False
        self.cut = 0
        self._running: dict[str, Callable[[], None]] = {}  # by job id: what ends that request now
        self._past_deadline = False

    def track(self, job_id: str, end: Callable[[], None]) -> None:
        """A request now waits on the engine; `end()` (run on the event loop) answers it 503. One
        that gets here after the deadline (it was being checked then) is answered at once."""
        if self._past_deadline:
            self.cut += 1
            end()
            return
        self._running[job_id] = end

    def untrack(self, job_id: str) -> None:
        self._running.pop(job_id, None)

    def cut_running(self) -> None:
        """Answer every request still running 503 (on the event loop: the handlers then reply
        at once, whatever the engine thread is doing, e.g. compiling)."""
        self._past_deadline = True
        self.cut += len(self._running)
        for end in list(self._running.values()):
            end()
        self._running.clear()


def _json(status: int, message: str, code: str | None, close: bool) -> tuple[Message, Message]:
    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False})


class _Refused(Exception):
    """A request the app never sees: the error to answer it with (None: the client has gone, there
    is no one to answer)."""

    def __init__(self, reply: tuple[int, str, str] | None):
        super().__init__(reply)
        self.reply = reply


class Guard:
    """The ASGI middleware of the module docstring. `counts[(route, status)]` is what /metrics shows
    (a route outside `routes` counts as "other"; a client gone before any response, 499)."""

    def __init__(self, app: ASGIApp, limits: Limits, lifecycle: Lifecycle, routes: set[str],
                 counts: dict[tuple[str, int], int]):
        self.app, self.limits, self.lifecycle, self.routes, self.counts = app, limits, lifecycle, routes, counts

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
        sent: dict[str, Any] = {"started": False, "status": 499, "sse": False, "done": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent["started"], sent["status"] = True, message["status"]
                sent["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                  for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        try:
            if self.lifecycle.stopping:
                raise _Refused(_STOPPING)
            body = await self._read_body(scope, receive)
            await self.app(scope, _replay(body, receive), tracked)
        except _Refused as e:
            if e.reply is not None:
                for message in _json(*e.reply, close=True):  # the rest of the body is not read: close
                    await tracked(message)
        except Exception as e:  # noqa: BLE001 (a handler's bug: answered and counted, the connection kept)
            print(f"acache_jax.serve: internal error on {scope['method']} {scope['path']}: {e!r}\n"
                  f"{traceback.format_exc()}", file=sys.stderr, end="", flush=True)
            error = ApiError(500, f"internal error: {type(e).__name__}: {e}")
            if not sent["started"]:
                for message in _json(500, error.message, None, close=False):
                    await tracked(message)
            elif sent["sse"] and not sent["done"]:
                data = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
                await tracked({"type": "http.response.body", "body": data, "more_body": False})
                sent["status"] = 500
            else:
                raise  # a started response of known length cannot be completed: uvicorn closes it
        finally:
            key = (route, sent["status"])
            self.counts[key] = self.counts.get(key, 0) + 1

    async def _read_body(self, scope: dict[str, Any], receive: Receive) -> bytes:
        """The whole request body, within `max_body_bytes` and `body_timeout` (from now: the
        headers are in), read before the app runs, so that the app never meets a half-read body."""
        limit = self.limits.max_body_bytes
        too_large = (413, f"the request body is larger than this server's limit of {limit} bytes "
                          "(--max-body-bytes)", "body_too_large")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and (len(length) > 18 or int(length) > limit):
            raise _Refused(too_large)  # before reading any of it
        deadline = time.monotonic() + self.limits.body_timeout
        chunks, size, more = [], 0, True
        while more:
            if self.lifecycle.stopping:
                raise _Refused(_STOPPING)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Refused((408, f"the request body did not arrive within {self.limits.body_timeout:g} s "
                                     "(--body-timeout)", "body_timeout"))
            try:
                message = await asyncio.wait_for(receive(), min(left, POLL_S))
            except TimeoutError:
                continue
            if message["type"] == "http.disconnect":
                raise _Refused(None)  # the client hung up mid-upload: no one to answer, nothing to log
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(too_large)
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's receive: the body read by the guard in one message, then the connection's own
    receive (which reports a disconnect: how a waiting request notices its client has gone)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def header_timeout_protocol(base: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base` (h11 or httptools; both keep the request in progress in
    `self.cycle`) with a deadline for a request's headers: `seconds` from the connection's opening,
    or from the first byte of a later request on it; a connection whose headers are not complete by
    then is closed. Between requests, uvicorn's keep-alive timeout applies as before."""

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type, misc]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            between = self.cycle is None or self.cycle.response_complete
            if not between and self._header_timer is not None:  # the headers are in
                self._header_timer.cancel()
                self._header_timer = None
            elif between and self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol


def graceful_server(config: Any, lifecycle: Lifecycle, grace: float) -> Any:
    """A uvicorn.Server whose shutdown first marks `lifecycle` stopping (new requests: 503) and, at
    `grace` seconds, answers every request still running 503 through the app (`cut_running`), so
    that uvicorn's own last resort, cancelling the handlers, is never reached: the config's
    `timeout_graceful_shutdown` should be a few seconds longer than `grace`."""
    import uvicorn  # noqa: PLC0415 (the serve extra: imported by those who run the server)

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            lifecycle.stopping = True
            timer = asyncio.get_running_loop().call_later(grace, lifecycle.cut_running)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return GracefulServer(config)

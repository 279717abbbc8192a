"""The HTTP side: FastAPI routes that check and tokenize requests, hand them to the engine thread
(`worker.Worker`) and wait on what it sends back, without ever blocking it.

Events from the engine thread reach a request's handler through an asyncio queue fed with
`call_soon_threadsafe`. A client that goes away (a closed stream, or a disconnect while a
non-streaming request waits) cancels its request, which frees its KV slots at once. In front of
the routes, `limits.Guard` reads bodies within the HTTP limits, answers what a handler raises and
counts every response; at the shutdown timeout `Lifecycle.cut_running` answers every request
still waiting 503 (a stream: an error event, then `[DONE]`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from acache_jax.network.config import DecodeConfig
from acache_jax.network.model import Model
from acache_jax.serve import protocol
from acache_jax.serve.limits import Guard, Lifecycle, Limits
from acache_jax.serve.protocol import ApiError
from acache_jax.serve.worker import Worker

DISCONNECT_POLL_S = 0.05  # how often a waiting request checks that its client is still there


ROUTES = {"/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions"}


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _deliver(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[tuple], None]:
    """The engine thread's way to a handler's queue. Once the server's loop has closed (the engine
    thread stops after uvicorn) nobody waits for the event: it is dropped instead of raising in the
    engine thread, which still has to free every slot and say so."""

    def emit(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop is closed
            pass

    return emit


def metrics_text(snapshot: dict[str, float], http: dict[tuple[str, int], int]) -> str:
    """Prometheus text exposition of the worker's numbers and the HTTP responses by route and status."""
    lines = []
    for name, value in sorted(snapshot.items()):
        if name == "time":
            continue
        kind = "counter" if name.endswith("_total") else "gauge"
        # every digit: `:g` kept six, so a counter past a million (tokens, bytes) stopped moving
        lines += [f"# TYPE acache_{name} {kind}", f"acache_{name} {int(value) if value.is_integer() else value!r}"]
    lines.append("# TYPE acache_http_responses_total counter")
    lines += [f'acache_http_responses_total{{route="{route}",status="{status}"}} {n}'
              for (route, status), n in sorted(http.items())]
    return "\n".join(lines) + "\n"


def create_app(model: Model, base: DecodeConfig, worker: Worker, served_name: str, limits: Limits | None = None,
               lifecycle: Lifecycle | None = None) -> FastAPI:
    """The app; the caller owns the worker (and stops it after the server has drained) and, to stop
    gracefully, the lifecycle (`limits.graceful_server`)."""
    app = FastAPI(title="acache-jax", docs_url=None, redoc_url=None)
    http: dict[tuple[str, int], int] = {}
    limits, lifecycle = limits or Limits(), lifecycle or Lifecycle()
    app.add_middleware(Guard, limits=limits, lifecycle=lifecycle, routes=ROUTES, counts=http)
    app.state.lifecycle = lifecycle

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail)))

    @app.get("/health")
    async def health():
        if not worker.alive:
            return _error(ApiError(503, "the engine thread has stopped"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": 0,
                                            "owned_by": "acache-jax"}]}

    @app.get("/metrics")
    async def metrics():
        numbers = worker.snapshot | {"requests_inflight": float(worker.inflight)}
        return PlainTextResponse(metrics_text(numbers, http), media_type="text/plain; version=0.0.4")

    async def handle(request: Request, chat: bool) -> Response:
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, a 5000-digit number
                why = "it nests too deeply" if isinstance(e, RecursionError) else str(e)
                raise ApiError(400, f"the request body is not valid JSON: {why}") from None
            job = await run_in_threadpool(protocol.parse, body, model, base, served_name, chat, limits.max_model_len,
                                          limits.max_prompt_tokens)
            events: asyncio.Queue = asyncio.Queue()
            worker.submit(job, _deliver(asyncio.get_running_loop(), events))
        except ApiError as e:
            return _error(e)
        lifecycle.track(job.id, lambda: events.put_nowait(("cut", ApiError(
            503, "the server is shutting down and this request did not finish in time", code="shutting_down"))))
        if job.stream:
            return StreamingResponse(_stream(request, job, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _wait(request, job, events)

    async def _next(request: Request, events: asyncio.Queue) -> tuple | None:
        """The next event from the engine thread; None once the client has gone away."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return None

    async def _wait(request: Request, job: protocol.Job, events: asyncio.Queue) -> Response:
        done = False
        try:
            while True:
                event = await _next(request, events)
                if event is None:
                    return Response(status_code=499)
                kind, value = event
                if kind in ("error", "cut"):  # cut: the engine still holds it, and is told below
                    done = kind == "error"
                    return _error(value)
                if kind == "done":
                    done = True
                    return JSONResponse(protocol.completion(job, value))
        finally:
            lifecycle.untrack(job.id)
            if not done:
                worker.cancel(job.id)

    async def _stream(request: Request, job: protocol.Job, events: asyncio.Queue) -> AsyncIterator[str]:
        sse = lambda obj: f"data: {json.dumps(obj)}\n\n"
        done = False
        try:
            yield sse(protocol.chunk(job, "" if not job.chat else None, first=True))
            while True:
                event = await _next(request, events)
                if event is None:
                    return
                kind, value = event
                if kind == "text":
                    yield sse(protocol.chunk(job, value))
                elif kind == "done":
                    done = True
                    yield sse(protocol.chunk(job, None, value.finish_reason, answer=value))
                    break
                else:  # an error, or cut at shutdown (the engine still holds it then, and is told below)
                    done = kind == "error"
                    yield sse(value.body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            lifecycle.untrack(job.id)
            if not done:  # the client went away, or the server is stopping
                worker.cancel(job.id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


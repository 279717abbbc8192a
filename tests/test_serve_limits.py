"""One request cannot hurt the server (issue 44): the server as a subprocess on 127.0.0.1 serving the
shipped model (context 512), called by real clients: httpx, http.client and raw sockets for the
half-sent requests.

One server serves the module (short header and body timeouts, lengths capped below the model's
context of 512, `--no-early-stop` so that a request of 448 tokens keeps running for seconds, two
engines so that one is kept for the defaults); its last test stops it with SIGTERM while a request
finishes. A second server is stopped with long requests
in flight, cut at its `--shutdown-timeout`. The guard's answer to a handler that raises is checked on
an in-process uvicorn, as no input the real server takes may make one raise.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.test_serve import HTTP, _free_port, _metrics, _settle, start_server
from tests.cli_process import rss_mb

HEADER_TIMEOUT, BODY_TIMEOUT = 2, 2
SERVER_FLAGS = ("--no-early-stop", "--max-engines", "2", "--header-timeout", str(HEADER_TIMEOUT),
                "--body-timeout", str(BODY_TIMEOUT), "--max-model-len", "480", "--max-prompt-tokens", "400",
                "--shutdown-timeout", "30")
PROMPT = ("<|user|> Story:\nMary went to the office. John went to the garden.\nQuestion: Where is Mary?\n"
          "Answer with one location:\n<|assistant|>")
LONG = 448  # max_tokens of a request that runs for seconds on a CPU: 14 blocks, every one computed


class Server:
    """A server subprocess whose stderr is read as it comes (a full pipe would block it)."""

    def __init__(self, *flags: str):
        self.proc, self.url = start_server(*flags)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.lines: list[str] = []
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._drain.start()

    def finish(self, timeout: float = 90) -> tuple[int, str]:
        """Once it has exited (after a SIGTERM): (its exit status, everything it wrote on stderr)."""
        status = self.proc.wait(timeout)
        self._drain.join(10)
        return status, "".join(self.lines)


@pytest.fixture(scope="module")
def server():
    s = Server(*SERVER_FLAGS)
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


def _raw(port: int, data: bytes, wait: float) -> tuple[bytes, float]:
    """Send `data` on a new connection and read until the server closes it (or `wait` passes):
    (what came back, seconds from the send to the close)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(data)
        start, got = time.perf_counter(), b""
        s.settimeout(wait)
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            got += b"<still open>"
        return got, time.perf_counter() - start


def _responses(url: str, route: str, status: int) -> float:
    """/metrics' count of the HTTP responses of this route and status."""
    label = f'acache_http_responses_total{{route="{route}",status="{status}"}} '
    return sum(float(line[len(label):]) for line in HTTP.get(url + "/metrics").text.splitlines()
               if line.startswith(label))


def _no_500s(url: str) -> None:
    text = HTTP.get(url + "/metrics").text
    assert 'status="500"' not in text, text


@pytest.mark.parametrize("max_tokens", [10**9, 10**8, 10**30])
def test_a_huge_max_tokens_is_refused_at_once_and_costs_no_memory(server, max_tokens):
    """Before: 10**8 took 3.8 s and RSS 463 -> 845 MB here (0.9 -> 2.8 GB in the issue), 10**9 92 s.
    The bound on RSS is generous (the row of 10**8 tokens alone is 0.4 GB)."""
    rss = rss_mb(server.proc.pid)
    start = time.perf_counter()
    r = HTTP.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens}, timeout=30)
    seconds = time.perf_counter() - start
    grown = rss_mb(server.proc.pid) - rss
    print(f"\nmax_tokens {max_tokens}: {r.status_code} in {seconds * 1e3:.0f} ms, RSS {rss:.0f} MB {grown:+.1f} MB")
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "at most 448" in r.json()["error"]["message"] and "(--max-model-len" in r.json()["error"]["message"]
    assert seconds < 1 and grown < 32


def test_prompts_longer_than_the_context_are_refused_in_bounded_time(server):
    """Tokenizing stops where the limit ends, and a piece that recurs is tokenized once: a 1.5 MB
    prompt of one line, 100 000 short lines (past --max-prompt-tokens 400), or a million blank lines
    (no tokens in this word-level vocabulary: the prompt is the 40 words after them, more than the
    32 that --max-model-len 480 leaves beside max_tokens 440) are each refused in bounded time
    (tokenized piece by piece, the million blank lines took 20 s)."""
    for prompt, max_tokens, flag in (("word " * 300_000, None, "--max-prompt-tokens"),
                                     ("a b\n" * 100_000, None, "--max-prompt-tokens"),
                                     ("\n" * 1_000_000 + "word " * 40, 440, "the 32 tokens this server's limit")):
        start = time.perf_counter()
        r = HTTP.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
        seconds = time.perf_counter() - start
        print(f"\n{len(prompt)} characters of {prompt[:6]!r}: {r.status_code} in {seconds:.2f} s")
        assert r.status_code == 400 and flag in r.json()["error"]["message"], r.text
        assert seconds < 5


SURROGATES = [  # raw JSON bodies: "\ud800" is valid JSON, and not Unicode text; the field the 400 names
    ("/v1/completions", b'{"prompt": "Story \\ud800 Mary"}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "affix": "\\udc80 few shots"}', "affix"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["a", "\\ud83d"]}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', None),
]


def test_a_lone_surrogate_is_a_400_naming_its_field_and_the_connection_stays_usable(server):
    """Before: a 500 with a tokenizer traceback in the log, and the next request on the same
    keep-alive connection failed with 'connection reset by peer'."""
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, raw, param in SURROGATES:
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param, r.text
            assert "lone surrogate" in error["message"] and "connection" not in r.headers
            assert client.get("/health").json() == {"status": "ok"}  # the same client, the same connection
        paired = client.post("/v1/completions", json={"prompt": PROMPT + " \U0001f600"})  # a real pair is text
        assert paired.status_code == 200, paired.text
    _no_500s(server.url)


BAD = [  # (path, body, the param its 400 names, words of its message)
    ("/v1/completions", {"prompt": "x", "selecter": "hkvd"}, "selecter", "unknown field selecter"),
    ("/v1/completions", {"prompt": "x", "messages": []}, "messages", "is for /v1/chat/completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_tail": "y"}, "prompt_tail",
     "is for /v1/completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "affix": "y", "affix_position": "infix"},
     "affix_position", "chat requests take a prefix or suffix affix"),
    ("/v1/completions", {"prompt": "x", "top_p": 0.5}, "top_p", "not supported"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options", "['x']"),
    ("/v1/completions", {"prompt": "x", "selector": "random"}, "selector", "not 'random'"),
    ("/v1/completions", {"prompt": "x", "anchor_mass": 2}, "anchor_mass", "(0, 1]"),
    ("/v1/completions", {"prompt": "x", "anchor_min_ratio": "0.1"}, "anchor_min_ratio", "must be a number"),
    ("/v1/completions", {"prompt": "x", "block_length": 10**9}, "block_length", "no room for a prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1e9}, "max_tokens", "must be an integer"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None, "nests too deeply"),
    ("/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None, "not valid JSON"),
]


def test_bad_input_is_a_400_never_a_500(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body, param, words in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.post(path, **kw)
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param and words in error["message"], (body, r.text)
    _no_500s(server.url)


def test_the_engine_knobs_are_taken_and_a_request_with_the_defaults_always_has_an_engine(server):
    """`selector`, `anchor_mass`, `anchor_min_ratio` are taken (ignored before: the accurate selector
    could not be asked for), and each response says in `acache.settings` what it ran with: unset
    knobs at the server's defaults, max_tokens as run, in whole blocks. --max-engines 2: while that
    long request holds the one engine for other settings, a third setting gets 429 telling it to use
    the defaults, and a request with the defaults runs, as does one that differs from them only in
    its threshold (it runs on the defaults' engine with its own). Before: a non-default request
    evicted the idle default engine, and a request with the defaults then got 429 'use the
    defaults'; and a request with its own threshold needed an engine of its own."""
    url = server.url
    knobs = {"selector": "hkvd", "anchor_mass": 0.9, "anchor_min_ratio": 0.1, "anchor_ratio": 0.3}
    long = {"prompt": PROMPT, "affix": "Answer with one word.\n", "max_tokens": 250, **knobs}  # 8 blocks
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(HTTP.post, url + "/v1/completions", json=long, timeout=120)
        deadline = time.time() + 60
        while _metrics(url)["acache_requests_running"] == 0:  # admitted: its engine compiles, then steps
            assert time.time() < deadline
            time.sleep(0.1)
        other = HTTP.post(url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0.5}, timeout=120)
        own = HTTP.post(url + "/v1/completions", json={"prompt": PROMPT, "threshold": 0.7}, timeout=120)
        with HTTP.stream("POST", url + "/v1/completions", json={"prompt": PROMPT, "stream": True}, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ran = running.result()
    assert other.status_code == 429 and other.headers["retry-after"] == "1", other.text
    assert "leave the decoding knobs out" in other.json()["error"]["message"]
    assert own.status_code == 200 and own.json()["acache"]["settings"]["threshold"] == 0.7, own.text
    assert "".join(c["choices"][0]["text"] for c in chunks) == "office", chunks
    default = chunks[-1]["acache"]["settings"]
    assert default["max_tokens"] == 32 and default["selector"] == "attention" and default["threshold"] == 0.9
    assert ran.status_code == 200, ran.text
    details = ran.json()["acache"]
    assert {k: details["settings"][k] for k in knobs} == knobs and details["settings"]["max_tokens"] == 256, details
    assert details["settings"]["cache"] == "acache" and details["affix_source"] == "declared"
    assert _settle(url)["acache_pool_blocks_used"] == 0


def test_a_client_that_leaves_while_its_engine_compiles_cancels_its_request(server):
    """A new setting compiles its engine for seconds; the client gives up after one. Before, the
    server never saw a non-streaming client leave: the request ran to its end (finished, not
    cancelled)."""
    url = server.url
    before = _metrics(url)
    with pytest.raises(httpx.TimeoutException):
        HTTP.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "cache": "dual"}, timeout=1)
    after = _settle(url)
    assert after["acache_requests_cancelled_total"] - before["acache_requests_cancelled_total"] == 1
    assert after["acache_requests_finished_total"] == before["acache_requests_finished_total"]
    assert after["acache_pool_blocks_used"] == 0


def test_a_20_mb_body_gets_413_and_the_server_stays_responsive(server):
    """Over --max-body-bytes (2 MiB by default): refused from its Content-Length before any of it is
    read, or once 2 MiB have come when it is sent chunked; /health answers meanwhile."""
    url = server.url
    big = b'{"prompt": "' + b"x" * (20 << 20) + b'"}'
    start = time.perf_counter()
    r = HTTP.post(url + "/v1/completions", content=big, timeout=30)
    seconds = time.perf_counter() - start
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    parts = iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)])
    chunked = HTTP.post(url + "/v1/completions", content=parts, timeout=30)  # no Content-Length
    assert chunked.status_code == 413, chunked.text
    start_health = time.perf_counter()
    assert HTTP.get(url + "/health").status_code == 200 and time.perf_counter() - start_health < 1
    print(f"\n20 MB body: 413 in {seconds * 1e3:.0f} ms")
    assert seconds < 2


def test_half_sent_requests_are_dropped_after_the_timeouts(server):
    """Headers that stop coming: the connection is closed after --header-timeout; a body that stops
    coming: 408 and closed after --body-timeout; a client that leaves mid-upload is counted (499),
    with no ClientDisconnect traceback (the last test reads the log). Twenty stalled connections at
    once leave /health answering at once."""
    port, url = server.port, server.url
    left = _responses(url, "/v1/completions", 499)
    with ThreadPoolExecutor(3) as pool:
        heads = pool.submit(_raw, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le", 15)
        silent = pool.submit(_raw, port, b"", 15)
        body = pool.submit(_raw, port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: 100\r\n\r\n{\"prompt\": ", 15)
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for i, s in enumerate(stalled):
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else
                      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        start = time.perf_counter()
        assert HTTP.get(url + "/health").status_code == 200
        health_s = time.perf_counter() - start
        leaver = socket.create_connection(("127.0.0.1", port))
        leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
        time.sleep(0.3)
        leaver.close()
        (head_got, head_s), (silent_got, silent_s), (body_got, body_s) = heads.result(), silent.result(), body.result()
    for s in stalled:
        s.close()
    print(f"\nheaders stalled: closed after {head_s:.2f} s, nothing sent {silent_s:.2f} s, body stalled {body_s:.2f} s; "
          f"/health {health_s * 1e3:.0f} ms with 20 stalled connections")
    assert head_got == silent_got == b"" and HEADER_TIMEOUT - 0.1 < min(head_s, silent_s)
    assert max(head_s, silent_s) < HEADER_TIMEOUT + 3
    assert body_got.startswith(b"HTTP/1.1 408 ") and b'"code": "body_timeout"' in body_got, body_got
    assert BODY_TIMEOUT - 0.1 < body_s < BODY_TIMEOUT + 3 and health_s < 1
    deadline = time.time() + 10
    while _responses(url, "/v1/completions", 499) == left:  # the leaver (and the stalled bodies, closed)
        assert time.time() < deadline
        time.sleep(0.2)


def test_a_handler_that_raises_is_answered_counted_and_keeps_its_connection():
    """No input the server takes makes a handler raise, so a bug is staged: the guard in front of an
    app on a real uvicorn (in this process) answers its exception with a 500 error object (in a
    stream that has started: an error event and [DONE]), counts it, and the keep-alive connection
    serves the next request. Before: the exception passed the counting middleware, and uvicorn
    reset the connection."""
    import uvicorn

    from acache_jax.serve.limits import Guard, Lifecycle, Limits

    async def app(scope, receive, send):
        await receive()
        if scope["path"] == "/boom":
            raise RuntimeError("a staged bug")
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
            raise RuntimeError("a staged bug mid-stream")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    counts: dict[tuple[str, int], int] = {}
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(Guard(app, Limits(), Lifecycle(), {"/boom", "/stream", "/ok"}, counts),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started:
            assert time.time() < deadline and thread.is_alive()
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        got = []
        for path in ("/boom", "/ok", "/stream", "/ok"):
            conn.request("GET", path)
            r = conn.getresponse()
            got.append((r.status, r.read().decode(), conn.sock))
        conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
    (boom, boom_body, sock), ok, (stream, stream_body, _), ok_again = got
    error = json.loads(boom_body)["error"]
    assert boom == 500 and error["type"] == "server_error" and "a staged bug" in error["message"]
    assert stream == 200 and stream_body.endswith("data: [DONE]\n\n") and "a staged bug mid-stream" in stream_body
    assert ok[:2] == ok_again[:2] == (200, "ok") and ok[2] is sock and ok_again[2] is sock  # one connection
    assert counts == {("/boom", 500): 1, ("/stream", 500): 1, ("/ok", 200): 2}


def test_sigterm_lets_running_requests_finish_and_exits_0(server):
    """The module server's end: a request in flight at SIGTERM (its first block compiling) finishes
    within --shutdown-timeout (30 s here): its client gets the whole answer, every block is freed,
    the exit status is 0, and nothing in the log of this module's abuse is a traceback."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(HTTP.post, server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 64},
                             timeout=60)
        time.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        r = answer.result()
    status, log = server.finish()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "office", r.text
    assert status == 0 and "stopped; 0 KV blocks left allocated" in log, log
    for word in ("Traceback", "ClientDisconnect", "Event loop is closed", "Exception in ASGI"):
        assert word not in log, log


def test_sigterm_cuts_what_runs_past_the_shutdown_timeout_and_tells_every_client():
    """Long requests in flight, streamed and not, at SIGTERM with --shutdown-timeout 1: within about
    a second each non-streaming client has a 503 error object, each stream an error event and then
    `data: [DONE]`; no new connection is taken; every block is freed, the engine thread ends (its
    'stopped' line), no traceback, exit status 3 (requests were cut). Before: a plain-text 500,
    streams cut off without [DONE], 'Event loop is closed' in the engine thread, and exit 0."""
    s = Server("--no-early-stop", "--shutdown-timeout", "1")
    try:
        assert HTTP.post(s.url + "/v1/completions", json={"prompt": PROMPT}, timeout=120).status_code == 200
        results: dict[str, tuple] = {}

        def plain(i: int) -> None:
            r = HTTP.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "seed": i}, timeout=60)
            results[f"plain {i}"] = (r.status_code, r.json(), time.perf_counter())

        def stream(i: int) -> None:
            with HTTP.stream("POST", s.url + "/v1/chat/completions", timeout=60, json={
                    "messages": [{"role": "user", "content": "Where is Mary?"}], "max_tokens": LONG, "seed": i,
                    "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line]
            results[f"stream {i}"] = (r.status_code, lines, time.perf_counter())

        threads = [threading.Thread(target=f, args=(i,)) for i in range(2) for f in (plain, stream)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while _metrics(s.url)["acache_requests_inflight"] < 4:
            assert time.time() < deadline
            time.sleep(0.1)
        sigterm = time.perf_counter()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listening socket is closed
            HTTP.post(s.url + "/v1/completions", json={"prompt": PROMPT}, timeout=5)
        for t in threads:
            t.join(60)
        status, log = s.finish()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert len(results) == 4, results
    for name, (code, got, when) in results.items():
        assert when - sigterm < 1 + 2.5, (name, when - sigterm)
        if name.startswith("plain"):
            assert code == 503 and got["error"]["code"] == "shutting_down" and got["error"]["type"] == "server_error"
        else:
            assert code == 200 and got[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in got), got
            events = [json.loads(line[6:]) for line in got[:-1]]
            assert "choices" in events[0] and events[-1]["error"]["code"] == "shutting_down", events
    print(f"\ncut at SIGTERM + 1 s: answered after {max(w for _, _, w in results.values()) - sigterm:.2f} s")
    assert status == 3, log
    assert "stopped; 0 KV blocks left allocated" in log and "4 request(s) still running" in log, log
    for word in ("Traceback", "Event loop is closed", "Exception in ASGI", "Cancel"):
        assert word not in log, log

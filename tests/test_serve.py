"""The OpenAI-compatible server, run for real: a subprocess on 127.0.0.1 serving the shipped model,
called over HTTP with httpx (and once with the openai client).

One server serves the whole file (compiling its programs is most of the time); each test leaves
it idle and every KV block free, and the last checks that SIGTERM stops it cleanly.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from eval import lm_eval_data
from eval.tasks import eval_split, get_task
from eval.tasks.layouts import affix_text, request_texts

ROOT = Path(__file__).resolve().parents[1]
BABI = eval_split(get_task("babi"), 0, 40)[1]
CODEBOOK_SHOTS, CODEBOOK = eval_split(get_task("codebook"), 0, 40)
SHOTS_B, CODEBOOK_B = eval_split(get_task("codebook"), 1, 40)  # another world: another few-shot block


# One client sends every request of these tests: httpx.get/post/stream build a client, and with it
# a TLS context from the CA bundle (about 40 ms of CPU), at each call, and the polls for a server's
# start and idleness make hundreds. Keep-alive off: each request still opens its own connection.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """The server as a subprocess on a free port of 127.0.0.1 with these flags, once /health answers:
    (the process, its stderr a text pipe; its base URL)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "acache_jax.serve", "--port", str(port), *flags], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            if HTTP.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.3)
    return proc, url


@pytest.fixture(scope="module")
def server():
    # Steps of at most 256 tokens: 8 concurrent requests of these lengths need more, so the tests
    # below (a stream's text equals the answer's, a discovered affix decodes as declared, every
    # request under load gets its one answer) run through steps the bound splits.
    proc, url = start_server("--max-batch", "8", "--max-queue", "16", "--max-step-tokens", "256")
    yield proc, url
    if proc.poll() is None:
        proc.kill()


def _post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    r = HTTP.post(url + path, json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """(the streamed text, every chunk); checks the SSE framing and the single [DONE] at the end."""
    chunks, done = [], 0
    with HTTP.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done, line
            if line == "data: [DONE]":
                done += 1
            else:
                chunks.append(json.loads(line[6:]))
    assert done == 1
    key = "delta" if path.endswith("chat/completions") else None
    text = "".join((c["choices"][0]["delta"].get("content") or "") if key else c["choices"][0]["text"]
                   for c in chunks)
    return text, chunks


def _metrics(url: str) -> dict[str, float]:
    lines = HTTP.get(url + "/metrics").text.splitlines()
    return {k: float(v) for k, v in (l.split(" ") for l in lines if l and not l.startswith("#") and "{" not in l)}


def _settle(url: str) -> dict[str, float]:
    """Metrics once nothing is in flight, running or waiting (the engine thread frees blocks as it
    goes idle; its other numbers are from its last step, in flight is live)."""
    deadline, last = time.time() + 120, None  # a loaded machine may still be cancelling or finishing requests
    while True:
        m = _metrics(url)
        idle = (m["acache_requests_inflight"] == m["acache_requests_running"] == m["acache_requests_waiting"]
                == m["acache_pool_blocks_used"] == 0)
        if idle and m == last:
            return m  # idle, and nothing changed since the last look: the counters are final
        last = m if idle else None
        assert time.time() < deadline, f"the server never went idle: {m}"
        time.sleep(0.25)


def _distinct(examples, position: str, n: int) -> list:
    """n examples whose texts differ (a repeated question would make a longer span recur)."""
    seen = {}
    for e in examples:
        seen.setdefault(request_texts(e, position), e)
    return list(seen.values())[:n]


def _prompt(example) -> str:
    return "".join(request_texts(example, "none"))


def test_models_health_and_task_answers(server):
    _, url = server
    assert HTTP.get(url + "/health").json() == {"status": "ok"}
    assert [m["id"] for m in HTTP.get(url + "/v1/models").json()["data"]] == ["llada-small"]
    questions = BABI[:6]
    with ThreadPoolExecutor(6) as pool:
        plain = list(pool.map(lambda q: _post(url, "/v1/completions", {"model": "llada-small", "prompt": _prompt(q)}),
                              questions))
        chat = list(pool.map(lambda q: _post(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": q.prompt.query(q.question)}]}), questions))
    assert sum(q.score(r["choices"][0]["text"]) for q, r in zip(questions, plain)) >= 5
    assert sum(q.score(r["choices"][0]["message"]["content"]) for q, r in zip(questions, chat)) >= 5
    assert all(r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] > 0 for r in plain)
    assert _settle(url)["acache_pool_blocks_used"] == 0


def test_streaming_gives_the_non_streaming_text(server):
    _, url = server
    full = _post(url, "/v1/completions", {"prompt": _prompt(BABI[12])})["choices"][0]["text"]
    assert len(full) >= 4
    for q, extra in ((BABI[10], {}), (BABI[11], {"max_tokens": 64}), (BABI[12], {"stop": ["zzz", full[2:4]]})):
        body = {"prompt": _prompt(q), **extra}
        _post(url, "/v1/completions", body)  # a repeated prompt is discovered: the next two both run against it
        whole = _post(url, "/v1/completions", body)["choices"][0]
        text, chunks = _stream(url, "/v1/completions", body)
        assert text == whole["text"] and text
        assert [c["choices"][0]["finish_reason"] for c in chunks].count(whole["finish_reason"]) == 1
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    assert whole["text"] == full[:2] and whole["finish_reason"] == "stop"  # cut before the stop string
    chat = {"messages": [{"role": "user", "content": BABI[13].prompt.query(BABI[13].question)}],
            "stream_options": {"include_usage": True}}
    text, chunks = _stream(url, "/v1/chat/completions", chat)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] > 0
    assert text == _post(url, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]


def _split(example, shots, position: str) -> tuple[str, str, str]:
    """(own text before, the span every such request shares, own text after) of a layout's prompt.
    Infix: the lines around the examples ("Example(s):", the line leading back) are shared too,
    so the shared span discovery finds is those lines and the examples."""
    head, tail = request_texts(example, position)
    block = affix_text(shots, position)
    if position == "prefix":
        return "", block, head
    own, intro = head.split("\n", 1)
    back, end = tail.split("\n", 1)
    return own + "\n", intro + block + back + "\n", end


def test_an_undeclared_few_shot_block_is_discovered_and_decodes_as_declared(server):
    """The same few-shot block in every request, never declared: from its second sighting it is a
    shared affix (built once), from its third read from the cache; each answer's tokens equal
    those of the same request with the span declared by hand, in prefix and in infix position."""
    _, url = server
    before = _metrics(url)
    for shots, examples, position in ((CODEBOOK_SHOTS, CODEBOOK, "prefix"), (SHOTS_B, CODEBOOK_B, "infix")):
        questions = _distinct(examples, position, 4)
        found = [_post(url, "/v1/completions", {"prompt": "".join(_split(q, shots, position))}) for q in questions]
        sources = [r["acache"]["affix_source"] for r in found]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in found]
        assert sources == [None, "discovered", "discovered", "discovered"], sources
        assert cached[:2] == [0, 0] and cached[2] > 0 and cached[3] == cached[2]
        assert found[2]["acache"]["affix_tokens"] - found[2]["acache"]["anchors"] == cached[2]
        for q, r in zip(questions[1:], found[1:]):
            before_text, shared, after_text = _split(q, shots, position)
            declared = {"prompt": before_text or after_text, "affix": shared, "affix_position": position}
            if position == "infix":
                declared["prompt_tail"] = after_text
            d = _post(url, "/v1/completions", declared)
            assert d["acache"]["affix_source"] == "declared" and d["acache"]["affix_tokens"] == r["acache"]["affix_tokens"]
            assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == cached[2]  # the same cache
            assert d["acache"]["token_ids"] == r["acache"]["token_ids"] and d["choices"][0]["text"] == r["choices"][0]["text"]
            assert d["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
        assert sum(q.score(r["choices"][0]["text"]) for q, r in zip(questions, found)) >= 2
    after = _settle(url)
    assert after["acache_affix_builds_discovered_total"] - before["acache_affix_builds_discovered_total"] == 2
    assert after["acache_affix_builds_declared_total"] == before["acache_affix_builds_declared_total"]


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": 5}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "32"}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "x", "threshold": 2}, 400),
    ("/v1/completions", {"prompt": "x", "cache": "prefix"}, 400),
    ("/v1/completions", {"prompt": "x", "anchor_ratio": True}, 400),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400),
    ("/v1/completions", {"prompt": "x", "affix": "y", "affix_position": "middle"}, 400),
    ("/v1/completions", {"prompt": "x", "affix": "y", "affix_position": "infix"}, 400),
    ("/v1/completions", {"prompt": "word " * 600}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400),
    ("/v1/nothing", {}, 404),
]


def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(server):
    _, url = server
    for path, body, status in BAD:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = HTTP.post(url + path, timeout=30, **kw)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] in ("invalid_request_error",), r.text
    assert HTTP.get(url + "/health").json() == {"status": "ok"}
    assert _post(url, "/v1/completions", {"prompt": _prompt(BABI[20])})["choices"][0]["text"]


def test_clients_that_disconnect_free_their_slots(server):
    """Near-uniform sampling (temperature 5) commits one token per step and rarely an end of text:
    these requests run for several blocks, and each client hangs up after its first chunk. Most
    are cancelled; on a loaded machine the server sees some hang-ups only after the request has
    committed an end of text and finished (8 of 12 were cancelled in one full-suite run on 2 cores),
    so the count asks for half: with cancellation broken, all 12 would finish."""
    _, url = server
    before = _metrics(url)

    def leave(q):
        body = {"prompt": _prompt(q), "stream": True, "max_tokens": 128, "temperature": 5.0}
        with HTTP.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # the first chunk, then hang up

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(leave, BABI[21:33]))
    after = _settle(url)
    cancelled = after["acache_requests_cancelled_total"] - before["acache_requests_cancelled_total"]
    finished = after["acache_requests_finished_total"] - before["acache_requests_finished_total"]
    assert cancelled >= 6 and cancelled + finished == 12, (cancelled, finished)
    assert after["acache_pool_blocks_used"] == 0 and after["acache_requests_running"] == 0


def test_queue_limit_answers_429_with_retry_after(server):
    """16 queued or running at most (the server's --max-queue): a burst of 24 gets some 429s."""
    _, url = server
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        with ThreadPoolExecutor(24) as pool:
            rs = list(pool.map(lambda q: client.post(url + "/v1/completions", json={"prompt": _prompt(q)}), BABI[:24]))
    refused = [r for r in rs if r.status_code == 429]
    assert refused and all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
                           for r in refused)
    assert all(r.status_code in (200, 429) for r in rs) and len(refused) <= 8
    assert _settle(url)["acache_pool_blocks_used"] == 0


LOAD_REQUESTS = 96  # each of the six kinds about 16 times; the 16-request queue turns over six times


def test_load_loses_nothing(server):
    """96 requests from 16 clients (the queue limit: none is refused): recurring few-shot blocks (prefix, infix), declared affixes,
    suffixes, plain questions, chat, streams; every one gets exactly one complete answer."""
    _, url = server
    rng = random.Random(0)
    jobs = []
    for i in range(LOAD_REQUESTS):
        kind = rng.choice(["plain", "chat", "prefix", "infix", "declared", "suffix"])
        q = BABI[i % 40]
        if kind == "plain":
            path, body = "/v1/completions", {"prompt": _prompt(q)}
        elif kind == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": q.prompt.query(q.question)}]}
        elif kind in ("prefix", "infix"):
            shots, c = (CODEBOOK_SHOTS, CODEBOOK) if i % 2 else (SHOTS_B, CODEBOOK_B)
            head, tail = request_texts(c[i % 40], kind)
            block = affix_text(shots, kind)
            path, body = "/v1/completions", {"prompt": block + head if kind == "prefix" else head + block + tail}
        elif kind == "declared":
            head, _ = request_texts(CODEBOOK[i % 40], "prefix")
            path, body = "/v1/completions", {"prompt": head, "affix": affix_text(CODEBOOK_SHOTS, "prefix")}
        else:
            head, _ = request_texts(CODEBOOK[i % 40], "suffix")
            path, body = "/v1/completions", {"prompt": head, "suffix": affix_text(CODEBOOK_SHOTS, "suffix")}
        body["max_tokens"] = 32
        jobs.append((path, body, rng.random() < 0.3))
    latency, answers, lock = [], {}, threading.Lock()

    def run(i):
        path, body, stream = jobs[i]
        start = time.perf_counter()
        if stream:
            text, chunks = _stream(url, path, body)
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
            ids = {c["id"] for c in chunks}
            assert len(ids) == 1 and len(finishes) == 1, chunks
            got = (ids.pop(), text, finishes[0])
        else:
            r = _post(url, path, body)
            c = r["choices"][0]
            got = (r["id"], c["text"] if "text" in c else c["message"]["content"], c["finish_reason"])
        with lock:
            latency.append(time.perf_counter() - start)
            answers[i] = got

    start = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(run, range(len(jobs))))
    seconds = time.perf_counter() - start
    n = LOAD_REQUESTS
    assert sorted(answers) == list(range(n)) and len({a[0] for a in answers.values()}) == n
    assert all(finish in ("stop", "length") for _, _, finish in answers.values())
    lat = sorted(latency)
    m = _settle(url)
    print(f"\nload: {n} requests, 16 clients, {seconds:.1f} s, {n / seconds:.1f} req/s, "
          f"p50 {lat[n // 2]:.2f} s, p99 {lat[int(0.99 * n)]:.2f} s, cached prompt tokens {m['acache_cached_tokens_total']:.0f} "
          f"of {m['acache_prompt_tokens_total']:.0f}")
    assert m["acache_pool_blocks_used"] == 0 and m["acache_cached_tokens_total"] > 0


def _readme_block(language: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"^```{language}\n(.*?)^```", readme[readme.index("## Serving\n"):], re.S | re.M).group(1)


def test_the_readme_examples_and_the_openai_client(server):
    _, url = server
    port = url.rsplit(":", 1)[1]
    for command in _readme_block("sh").splitlines():
        run = subprocess.run(["bash", "-c", command.replace("localhost:8000", f"127.0.0.1:{port}")],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and ('"choices"' in run.stdout), (command, run.stdout, run.stderr)
    assert "garden" in run.stdout or "office" in run.stdout
    code = _readme_block("py").replace("http://127.0.0.1:8000", url).replace('"..."', json.dumps(
        BABI[39].prompt.query(BABI[39].question)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # noqa: S102 (the documented example itself)
    answer, cached = out.getvalue().rsplit(" ", 1)
    assert BABI[39].score(answer) and cached.strip() == "0"


def test_lm_eval_runs_a_task_through_the_server(server, tmp_path):
    """The README's lm-eval command: lm-eval's own `local-chat-completions` model pointed at the
    server answers every arithmetic document as the same server answers that document's query (one
    line each: no span recurs, so discovery serves both alike)."""
    _, url = server
    lm_eval_data.write(tmp_path / "data", ["arithmetic"], 8)
    command = _readme_block("shell").strip().replace("localhost:8000", url.removeprefix("http://"))
    run = subprocess.run(["bash", "-c", command.replace("out/lm_eval_server", str(tmp_path / "out"))], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ACACHE_LM_EVAL_DATA": str(tmp_path / "data"), "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["acache_arithmetic"]
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).read_text().splitlines()]
    assert len(samples) == 8
    for s in samples:
        direct = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": s["doc"]["query"]}]})
        assert s["resps"][0][0] == direct["choices"][0]["message"]["content"]
    assert results["acc,none"] >= 0.75
    assert _settle(url)["acache_pool_blocks_used"] == 0


def test_sigterm_stops_cleanly(server):
    proc, _ = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    err = proc.stderr.read()
    assert "stopped; 0 KV blocks left allocated" in err and "Traceback" not in err, err

"""The server under load, online affix discovery on and off side by side.

    python -m eval.bench_serve --model acache_jax/models/llada-small [--requests 200] [--clients 16]
    python -m eval.bench_serve --shape llada [--layers 4] [--requests 400] [--clients 32]  # 8B-shaped, random

Each run starts the real server in this process (the app and engine thread of `acache_jax.serve`,
uvicorn on a free port of 127.0.0.1) and sends it completions from `--clients` concurrent HTTP
clients. The requests mix recurring spans and unique text: a fraction `--recurring` of them holds
one of `--spans` few-shot blocks (examples of a seeded task world; `--shots` examples each), at the
start (prefix) or inside (infix, with the lines around it); every request has its own question.
No affix is declared: only discovery can find the blocks. With `--shape` the weights are random
(LLaDA-8B / Dream-7B shapes, bf16) and decoding follows a fixed schedule of `--tokens-per-step`;
texts are tokenized with the shipped tokenizer (ids valid in any vocabulary). Warm-up passes of the
same requests compile the programs before each measured pass (until one compiles nothing, at most
`--warmup-passes`: concurrent clients batch the requests differently in every pass). Reports per
setting: requests/s, generated tokens/s, the fraction of prompt tokens read from a shared cache,
latency p50 / p99, and what the measured pass still compiled. With `--warmup-tokens N` the server
runs fixed shapes and compiles every step program of up to N tokens when it starts (as
`python -m acache_jax.serve --warmup-tokens N` does), so the program set no longer depends on how
the clients' requests happen to be batched.
`--compare early-stop` runs early stop off and on instead (discovery on in both): what the
server saves by ending requests whose answer has ended.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from acache_jax import compile_cache
from acache_jax.cli import DEFAULT_MODEL
from acache_jax.network.checkpoint import load
from acache_jax.network.files import check_output_path, write_atomic
from eval.bench_traffic import add_common_flags, counting_compiles, shaped_model


def workload(n: int, spans: int, shots: int, recurring: float, rng: np.random.Generator) -> list[str]:
    """n prompts: a `recurring` fraction hold one of `spans` few-shot blocks (prefix or infix)."""
    from eval.tasks import get_task
    from eval.tasks.layouts import affix_text, request_texts

    codebook, babi = get_task("codebook"), get_task("babi")
    blocks = {p: [affix_text(codebook.generate(np.random.default_rng([s, 7]), shots), p) for s in range(spans)]
              for p in ("prefix", "infix")}
    questions = babi.generate(np.random.default_rng([spans, 11]), n)
    prompts = []
    for q in questions:
        if rng.random() >= recurring:
            prompts.append("".join(request_texts(q, "none")))
            continue
        position = "prefix" if rng.random() < 0.5 else "infix"
        block = blocks[position][int(rng.integers(spans))]
        head, tail = request_texts(q, position)
        prompts.append(block + head if position == "prefix" else head + block + tail)
    return prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """The server's app and worker on a uvicorn thread (stopped with `close`)."""

    def __init__(self, model, base, settings, name: str):
        import uvicorn

        from acache_jax.serve.app import create_app
        from acache_jax.serve.worker import Worker

        self.worker = Worker(model, settings)
        self.port = _free_port()
        config = uvicorn.Config(create_app(model, base, self.worker, name), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.stop()


def drive(url: str, name: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """Send every prompt from `clients` threads; throughput, cached fraction and latency."""
    import httpx

    latency, usage = [], []
    lock = threading.Lock()
    with httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        def one(prompt: str) -> None:
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": max_tokens})
            r.raise_for_status()
            with lock:
                latency.append(time.perf_counter() - start)
                usage.append(r.json()["usage"])

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, prompts))
        seconds = time.perf_counter() - start
    prompt = sum(u["prompt_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    lat = np.asarray(latency)
    return dict(requests=len(prompts), seconds=seconds, requests_per_s=len(prompts) / seconds,
                generated_tokens_per_s=len(prompts) * max_tokens / seconds,
                answer_tokens=sum(u["completion_tokens"] for u in usage), cached_fraction=cached / max(1, prompt),
                p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.bench_serve", description=__doc__.splitlines()[0])
    add_common_flags(p, model_help="a model directory (default: the shipped model)", model_required=False,
                     requests=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--spans", type=int, default=4, help="distinct recurring few-shot blocks")
    p.add_argument("--shots", type=int, default=4, help="examples per block")
    p.add_argument("--recurring", type=float, default=0.75, help="fraction of requests holding a block")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-tokens", type=int, default=64, help="discovery: tokens a span must have")
    p.add_argument("--compare", choices=["discovery", "early-stop"], default="discovery",
                   help="what the two passes differ in: discovery off/on, or early stop off/on (discovery on)")
    p.add_argument("--warmup-passes", type=int, default=3, help="at most this many before each measured pass")
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="compile every step program up to this many tokens when the server starts (fixed shapes)")
    return p


def main(argv: list[str] | None = None) -> int:
    from acache_jax.serve.worker import Settings

    args = parser().parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    if args.json:
        check_output_path(args.json)
    shipped = load(args.model or DEFAULT_MODEL)
    if args.shape:
        model = dataclasses.replace(shaped_model(args.shape, args.layers), tokenizer=shipped.tokenizer)
        base = model.decode_config(gen_length=args.max_tokens, block_length=args.block, threshold=None,
                                   steps=args.max_tokens // args.tokens_per_step, cache="acache")
    else:
        model = shipped
        base = model.decode_config(gen_length=args.max_tokens, block_length=args.block, cache="acache")
    prompts = workload(args.requests, args.spans, args.shots, args.recurring, np.random.default_rng(args.seed))
    name = args.shape or (args.model or DEFAULT_MODEL).name
    result = dict(model=name, requests=args.requests, clients=args.clients, spans=args.spans, shots=args.shots,
                  recurring=args.recurring, max_tokens=args.max_tokens)
    arms = (("discovery_off", False, True), ("discovery_on", True, True)) if args.compare == "discovery" else (
        ("early_stop_off", True, False), ("early_stop_on", True, True))
    for label, discovery, early in arms:
        settings = Settings(max_batch=args.max_batch, max_queue=max(256, args.clients), discovery=discovery,
                            min_tokens=args.min_tokens, finish_early=early, warmup_tokens=args.warmup_tokens)
        # Each pass on a fresh server, so that discovery starts cold in every one; the compiled
        # programs are the process's and carry over.
        serve = lambda: InProcessServer(model, base.replace(early_stop=early), settings, name)  # noqa: E731
        if args.warmup_tokens:
            server = serve()
            try:
                with counting_compiles() as warm:
                    server.worker.warm_up(base.replace(early_stop=early)).wait()
            finally:
                server.close()
            print(json.dumps({label: "start-up", **warm}), flush=True)
        for _ in range(args.warmup_passes):
            server = serve()
            try:
                with counting_compiles() as warm:
                    drive(server.url, name, prompts, args.clients, args.max_tokens)
            finally:
                server.close()
            print(json.dumps({label: "warm-up", **warm}), flush=True)
            if not warm["compiles"]:
                break
        server = serve()
        try:
            with counting_compiles() as compiled:
                result[label] = drive(server.url, name, prompts, args.clients, args.max_tokens)
            result[label].update(compiled)
        finally:
            server.close()
        print(json.dumps({label: result[label]}), flush=True)
    (off, _, _), (on, _, _) = arms
    result["speedup"] = result[on]["requests_per_s"] / result[off]["requests_per_s"]
    print(json.dumps(result))
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

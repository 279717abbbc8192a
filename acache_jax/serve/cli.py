"""Command line: `python -m acache_jax.serve [--model DIR] [--host H] [--port P] [flags]` (see --help).

Decoding settings start from the model's generation_config.json, then these flags, then each
request's knobs. The server defaults to ACache (`--cache acache`) with early stop, and discovers
shared spans unless `--no-discovery`. The one KV pool every engine runs in holds `--max-batch`
requests of `--max-model-len` tokens, a length chosen to fit the device memory the weights leave unless given
(`serve_context`). SIGTERM or Ctrl-C: no new requests are accepted, running ones get
`--shutdown-timeout` seconds to finish, the rest are answered 503 (a stream: an error event and
`[DONE]`); every KV slot is freed. Exit status: 0 when every request finished, 3 when the shutdown
cut some, 1 when the server could not start or its engine thread did not stop, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from acache_jax import compile_cache
from acache_jax.cli import DEFAULT_MODEL, Parser, add_compile_cache, positive, threshold
from acache_jax.engine.engine import DEFAULT_STEP_TOKENS, ENGINE_POLICIES, check_engine_config, default_pool_tokens
from acache_jax.network.checkpoint import load
from acache_jax.network.config import ATTENTION_BACKENDS, InputError
from acache_jax.network.kv import KVPool
from acache_jax.network.tokenizer import loaded_tokenizer
from acache_jax.serve.limits import Lifecycle, Limits, graceful_server, header_timeout_protocol

if TYPE_CHECKING:
    import uvicorn

    from acache_jax.network.config import DecodeConfig
    from acache_jax.serve.worker import Worker

EXIT_CUT = 3  # the shutdown timeout cut running requests (each was answered 503)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (a limit of 0 or inf would be no limit, or no service)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m acache_jax.serve", description=__doc__.splitlines()[0])
    unset = argparse.SUPPRESS
    p.add_argument("--model", type=Path, help="converted or HF LLaDA/Dream directory (default: the shipped model)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="weights dtype (default: as stored)")
    p.add_argument("--gen-length", type=positive, default=unset, help="default max_tokens (default: the model's)")
    p.add_argument("--block-length", type=positive, default=unset, help="decoding block (default: the model's)")
    p.add_argument("--threshold", type=threshold, default=unset, help="confidence threshold or 'none'")
    p.add_argument("--steps", type=positive, default=unset, help="fixed-schedule steps over --gen-length")
    p.add_argument("--cache", choices=list(ENGINE_POLICIES), default="acache", help="default cache policy")
    p.add_argument("--anchor-ratio", type=float, default=unset, help="acache: anchors per affix token")
    p.add_argument("--no-early-stop", dest="early_stop", action="store_false",
                   help="compute every block, even once the answer has ended (measurements)")
    p.add_argument("--backend", choices=ATTENTION_BACKENDS, help="attention backend (default: pallas on a GPU)")
    p.add_argument("--max-batch", type=positive, default=16, help="requests decoded together per engine")
    p.add_argument("--pool-tokens", type=positive,
                   help="the KV pool, which every engine shares, in tokens (default: --max-batch x --max-model-len; "
                        "at --max-batch 1, room for a request's anchors too)")
    p.add_argument("--max-engines", type=positive, default=4,
                   help="distinct decoding settings served at once (settings that differ only in temperature, "
                        "threshold, factor or the anchor ratios count as one)")
    p.add_argument("--max-queue", type=positive, default=256, help="requests queued or running; more get 429")
    p.add_argument("--no-discovery", dest="discovery", action="store_false", help="serve declared affixes only")
    p.add_argument("--affix-min-count", type=positive, default=2, help="requests a span must recur in")
    p.add_argument("--affix-min-tokens", type=positive, default=64, help="tokens a discovered span must have")
    p.add_argument("--affix-memory-mb", type=positive, default=1024, help="budget of the stored affix caches")
    p.add_argument("--warmup-tokens", type=_non_negative, default=0,
                   help="compile every program of steps up to this many tokens at start (on a GPU: about "
                        "max batch x prompt + answer tokens; 0: compile as requests first need them)")
    p.add_argument("--max-step-tokens", type=positive, default=None,
                   help="the most tokens one engine step computes (bounds its activations; probes and block "
                        f"starts beyond it wait a step); default: --warmup-tokens when set, else "
                        f"{DEFAULT_STEP_TOKENS}")
    p.add_argument("--min-affix-reuse", type=_non_negative, default=0,
                   help="acache: a request whose affix tokens x generation blocks fall below this runs as dual, "
                        "its probe costing more than its affix saves when it runs alone (about 920 on an H100 "
                        "at 8B shape: docs/BENCHMARKS.md); default 0: every request with an affix runs ACache")
    p.add_argument("--shutdown-timeout", type=_seconds, default=10.0,
                   help="seconds running requests get at SIGTERM; those still running then get a 503")
    limits = Limits()
    p.add_argument("--max-body-bytes", type=positive, default=limits.max_body_bytes,
                   help="largest request body; a larger one gets 413 (default: %(default)s)")
    p.add_argument("--header-timeout", type=_seconds, default=limits.header_timeout,
                   help="seconds a request's headers may take from its first byte; then the connection is "
                        "dropped (default: %(default)s)")
    p.add_argument("--body-timeout", type=_seconds, default=limits.body_timeout,
                   help="seconds a request's body may take after its headers; then 408 and the connection is "
                        "closed (default: %(default)s)")
    p.add_argument("--max-header-bytes", type=positive, default=limits.max_header_bytes,
                   help="largest request head (request line and headers; h11, the HTTP parser installed by "
                        "default); larger: 400 (default: %(default)s)")
    p.add_argument("--keep-alive-timeout", type=positive, default=limits.keep_alive_timeout,
                   help="seconds an idle keep-alive connection is kept (default: %(default)s)")
    p.add_argument("--max-model-len", type=positive,
                   help="most prompt + generated tokens of a request (at most the model's context; default: the "
                        "model's context, or where a pool of --max-batch requests that long would not fit in half "
                        "the device memory the weights leave, the longest power of two that does)")
    p.add_argument("--max-prompt-tokens", type=positive,
                   help="most prompt tokens (affix and tail included; default: what the context leaves)")
    add_compile_cache(p)
    return p


def _check_lengths(args: argparse.Namespace, context: int, gen_length: int) -> None:
    """--max-model-len within the model's context, and room beside the default generation length for
    a prompt (else every request without max_tokens would be refused)."""
    if args.max_model_len is not None and args.max_model_len > context:
        raise InputError(f"--max-model-len {args.max_model_len} exceeds the model's context of {context} tokens")
    if gen_length >= (args.max_model_len or context):
        raise InputError(f"the default generation length {gen_length} (--gen-length, else the model's) leaves no room "
                         f"for a prompt in {args.max_model_len or context} tokens")


def free_device_bytes() -> int | None:
    """Memory free now on the device the server runs on (its allocator's limit less what is in use:
    after loading, less the weights), or None where the backend does not say (a CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats["bytes_in_use"]


def serve_context(model_context: int, max_batch: int, token_bytes: int, free_bytes: int | None, gen_length: int,
                  config: DecodeConfig, max_model_len: int | None = None, pool_tokens: int | None = None
                  ) -> tuple[int, str | None]:
    """(the context requests get, the server's max-model-len; a line saying why, when it is below
    the model's and no flag set it), so that the KV pool (`token_bytes` a token; every engine runs
    in it) fits in half of `free_bytes`, the device memory free after the weights (None: not known, nothing is
    checked); the other half is for activations (a step of --warmup-tokens tokens) and compiled
    programs. The default engine's pool (`default_pool_tokens` of its `config`) is max_batch
    requests of that context: the model's, unless that would not fit (Dream's 131072 tokens x 16
    are 112 GiB of K/V), then the longest power of two that does, with room for a prompt as long
    as the default answer. A --max-model-len or --pool-tokens whose pool does not fit is an
    InputError: one line at start, not an out-of-memory error in the warm-up or a first request."""
    budget = None if free_bytes is None else free_bytes // 2
    pool = lambda context: default_pool_tokens(config, max_batch, context)
    fits = lambda tokens: budget is None or tokens * token_bytes <= budget
    kv = lambda tokens: _size(tokens * token_bytes)
    room = "" if budget is None else (f"half of the {_size(free_bytes)} the device has free after the weights "
                                      f"({budget // token_bytes} tokens of KV at {token_bytes} bytes each)")
    if pool_tokens is not None:
        if not fits(pool_tokens):
            raise InputError(f"--pool-tokens {pool_tokens} needs {kv(pool_tokens)} of KV, more than {room}")
        if max_model_len is not None and max_model_len > pool_tokens:
            raise InputError(f"--max-model-len {max_model_len} exceeds --pool-tokens {pool_tokens}: a request that "
                             "long would never fit in the pool")
        return max_model_len or model_context, None
    if max_model_len is not None:
        if not fits(pool(max_model_len)):
            raise InputError(f"a KV pool of --max-batch {max_batch} x --max-model-len {max_model_len} tokens needs "
                             f"{kv(pool(max_model_len))} of KV, more than {room}; lower either, or set "
                             "--pool-tokens")
        return max_model_len, None
    if fits(pool(model_context)):
        return model_context, None
    least = min(2 * gen_length, model_context)  # the default answer, and as long a prompt
    context = 1 << max(0, (model_context - 1).bit_length() - 1)  # the longest power of two below the model's
    while context and not fits(pool(context)):
        context >>= 1
    if context < least:
        raise InputError(f"a KV pool of --max-batch {max_batch} requests of even {least} tokens (the default "
                         f"generation length {gen_length} and a prompt) needs {kv(pool(least))} of KV, more "
                         f"than {room}; lower --max-batch, or set --pool-tokens")
    return context, (f"requests of up to {context} tokens (the model's context is {model_context}): a KV pool of "
                     f"--max-batch {max_batch} x {model_context} tokens would need {kv(pool(model_context))} "
                     f"of KV, more than {room}; --max-model-len, --pool-tokens or --max-batch change this")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import uvicorn
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from acache_jax.serve.app import create_app
        from acache_jax.serve.protocol import engine_config
        from acache_jax.serve.worker import Settings, Worker
    except ImportError as e:
        print(f"error: the server needs the serve extra (pip install 'acache-jax[serve]'): {e}", file=sys.stderr)
        return 2
    compile_cache.enable(args.compile_cache)  # before the first compile: the warm-up's programs are kept
    try:
        model = load(args.model or DEFAULT_MODEL, dtype=args.dtype)
        loaded_tokenizer(model.tokenizer)  # a damaged tokenizer file is an error now, not at a first request
        fields = {k: getattr(args, k) for k in ("gen_length", "block_length", "threshold", "steps", "anchor_ratio")
                  if hasattr(args, k)}
        base = model.decode_config(**fields, cache=args.cache, early_stop=args.early_stop, attn_backend=args.backend)
        check_engine_config(base)
        _check_lengths(args, model.config.max_seq_len, base.gen_length)
        context, note = serve_context(model.config.max_seq_len, args.max_batch,
                                      KVPool.slot_bytes(model.config, model.dtype), free_device_bytes(),
                                      base.gen_length, base, args.max_model_len, args.pool_tokens)
        settings = Settings(max_batch=args.max_batch, pool_tokens=args.pool_tokens, context=context,
                            max_engines=args.max_engines, max_queue=args.max_queue, discovery=args.discovery,
                            min_count=args.affix_min_count, min_tokens=args.affix_min_tokens,
                            affix_budget_bytes=args.affix_memory_mb << 20,
                            finish_early=args.early_stop, warmup_tokens=args.warmup_tokens,
                            max_step_tokens=args.max_step_tokens, min_affix_reuse=args.min_affix_reuse,
                            default_engine=engine_config(base))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if note:
        print(f"acache_jax.serve: {note}", file=sys.stderr, flush=True)
    name = args.served_model_name or (args.model or DEFAULT_MODEL).resolve().name
    worker = Worker(model, settings)
    if settings.warmup_tokens:
        worker.warm_up(base)
    limits = Limits(args.max_body_bytes, args.header_timeout, args.body_timeout, args.max_header_bytes,
                    args.keep_alive_timeout, context, args.max_prompt_tokens)
    lifecycle = Lifecycle()
    app = create_app(model, base, worker, name, limits, lifecycle)
    # uvicorn's own last resort at shutdown (cancelling handlers) comes only well after the app has
    # answered every request still running at --shutdown-timeout (graceful_server)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            http=header_timeout_protocol(AutoHTTPProtocol, limits.header_timeout),
                            h11_max_incomplete_event_size=limits.max_header_bytes,
                            timeout_keep_alive=limits.keep_alive_timeout,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    server = graceful_server(config, lifecycle, args.shutdown_timeout)
    print(f"acache_jax.serve: {name} on http://{args.host}:{args.port} (cache {base.cache}, discovery "
          f"{'on' if args.discovery else 'off'})", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has drained; SIGTERM has then done its job
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()  # returns after SIGTERM / Ctrl-C, once open requests finished or were answered 503
    except KeyboardInterrupt:
        pass
    finally:
        worker.stop()  # cancels what is left and frees every slot
    return _exit_status(server, worker, lifecycle)


def _exit_status(server: uvicorn.Server, worker: Worker, lifecycle: Lifecycle) -> int:
    """0: served and stopped with every request finished; EXIT_CUT: the shutdown timeout cut some
    (said on stderr); 1: never started, or the engine thread did not stop."""
    if not server.started:
        return 1
    if worker.alive:
        print("acache_jax.serve: the engine thread did not stop in time", file=sys.stderr, flush=True)
        return 1
    if lifecycle.cut:
        print(f"acache_jax.serve: {lifecycle.cut} request(s) still running at --shutdown-timeout were "
              "answered 503", file=sys.stderr, flush=True)
        return EXIT_CUT
    return 0

"""Command line: `python -m acache_jax.generate --prompt "..."` (see --help).

Requests come from --prompt / --prompt-ids, or one per line of --input FILE.jsonl (a file, a pipe, or
`-` for standard input), where each line is an object whose keys are the flag names without dashes
(`-` as `_`) and override the flags for that request. Decoding settings start from the model's
generation_config.json; flags override them. Requests with equal decoding settings and affix are
batched; every line is checked before any work starts (every bad line is reported), and results are
printed in input order as soon as they and all earlier ones are done.

A shared affix (--affix TEXT or --affix-ids) is placed as prefix ([affix][prompt]), infix
([prompt][affix][prompt tail]) or suffix ([prompt][generation][affix]). With an affix, texts are
tokenized as plain spans (no chat template, no BOS) so that the pieces join exactly.

The answer goes to stdout, the per-request statistics line to stderr (--json: one object per
request on stdout, statistics included).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

from jax.sharding import Mesh

from acache_jax import compile_cache
from acache_jax.cli import DEFAULT_MODEL, Parser, add_compile_cache, positive, threshold
from acache_jax.decoding.acache import AffixCache, build_affix_cache
from acache_jax.decoding.decode import check_policy, generate
from acache_jax.decoding.layout import (AFFIX_POSITIONS, MAX_SEED, Request, RequestError, check_affix, check_request,
                                        token_ids)
from acache_jax.engine import Engine
from acache_jax.engine.engine import check_engine_config, pool_for
from acache_jax.network.checkpoint import load
from acache_jax.network.config import (ATTENTION_BACKENDS, CACHE_POLICIES, FIELD_KINDS, SELECTORS, DecodeConfig,
                                       DreamAlg, InputError, Remasking)
from acache_jax.network.model import Model, check_text
from acache_jax.network.sharding import initialize_distributed, make_mesh
from acache_jax.network.tokenizer import LazyTokenizer

# Per-request keys of --input lines that map onto DecodeConfig fields: every field but classifier-free
# guidance (not a flag: likelihood scoring's) and the attention backend (--backend, for the whole run).
DECODE_KEYS = tuple(k for k in FIELD_KINDS if k not in ("cfg_scale", "attn_backend"))
# The other keys of an --input line, with the type each must have.
REQUEST_KEYS = {"prompt": str, "prompt_ids": list, "affix": str, "affix_ids": list, "prompt_tail": str,
                "prompt_tail_ids": list, "seed": int, "no_chat": bool, "affix_position": str}
WINDOW_BATCHES = 4  # the static path decodes this many batches of input lines, then prints them
MAX_REPORTED = 20  # bad --input lines reported by name; the rest are counted


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, {MAX_SEED}], got {text}")
    return value


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m acache_jax.generate", description=__doc__.splitlines()[0])
    unset = argparse.SUPPRESS  # decoding flags not given keep the model's generation defaults
    p.add_argument("--model", type=Path, help="converted or HF LLaDA/Dream directory (default: the shipped model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="weights dtype (default: as stored)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (chat template applied when the tokenizer has one)")
    src.add_argument("--prompt-ids", type=_ids, help="raw prompt token ids, e.g. 1,2,3 (no template, no BOS)")
    src.add_argument("--input", type=Path, help="JSONL file, one request object per line")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template to --prompt")
    affix = p.add_mutually_exclusive_group()
    affix.add_argument("--affix", help="shared affix text")
    affix.add_argument("--affix-ids", type=_ids, help="shared affix token ids")
    p.add_argument("--affix-position", choices=AFFIX_POSITIONS, help="where the affix goes (default: prefix)")
    tail = p.add_mutually_exclusive_group()
    tail.add_argument("--prompt-tail", help="infix: the prompt text after the affix")
    tail.add_argument("--prompt-tail-ids", type=_ids, help="infix: the prompt token ids after the affix")
    p.add_argument("--gen-length", type=positive, default=unset, help="tokens to generate (default: the model's)")
    p.add_argument("--block-length", type=positive, default=unset, help="decoding block (default: the model's)")
    p.add_argument("--steps", type=positive, default=unset, help="fixed-schedule steps (default: gen length)")
    p.add_argument("--threshold", type=threshold, default=unset,
                   help="confidence threshold, or 'none' for the fixed schedule (default: the model's)")
    p.add_argument("--factor", type=float, default=unset, help="Fast-dLLM factor rule instead of the threshold")
    p.add_argument("--temperature", type=float, default=unset)
    p.add_argument("--remasking", choices=get_args(Remasking), default=unset,
                   help="LLaDA: which proposals a fixed-schedule step commits (default: the model's)")
    p.add_argument("--alg", choices=get_args(DreamAlg), default=unset,
                   help="Dream: the confidence a step ranks proposals by (default: the model's)")
    p.add_argument("--alg-temp", type=float, default=unset, help="Dream: temperature of that ranking")
    p.add_argument("--top-p", type=float, default=unset, help="Dream: nucleus sampling")
    p.add_argument("--top-k", type=positive, default=unset, help="Dream: top-k sampling")
    p.add_argument("--cache", choices=CACHE_POLICIES, default=unset,
                   help="none | prefix | dual (Fast-dLLM) | acache (anchors recomputed) | direct (affix cache as is)")
    p.add_argument("--anchor-ratio", type=float, default=unset,
                   help="acache: anchors per affix token (with --anchor-mass: at most)")
    p.add_argument("--anchor-mass", type=float, default=unset,
                   help="acache, adaptive budget: per request the fewest best-ranked affix tokens that hold this "
                        "share of the selector's scores")
    p.add_argument("--anchor-min-ratio", type=float, default=unset,
                   help="acache, adaptive budget: at least this many anchors per affix token")
    p.add_argument("--selector", choices=SELECTORS, default=unset, help="acache: how anchors are chosen")
    p.add_argument("--drop-non-anchor", action="store_true", default=unset, help="acache DropNA ablation")
    p.add_argument("--no-early-stop", dest="early_stop", action="store_false", default=unset,
                   help="compute every block even after an all end-of-text one (upstream parity)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--batch-size", type=positive, default=16, help="largest batch to run at once")
    p.add_argument("--backend", default=None, choices=ATTENTION_BACKENDS,
                   help="attention backend (default: pallas on a GPU, else xla)")
    p.add_argument("--engine", action="store_true",
                   help="serve the requests with the continuous-batching engine (cache dual, acache or direct)")
    p.add_argument("--pool-tokens", type=positive, default=None,
                   help="engine: KV pool size in tokens (default: batch size x the model's context)")
    p.add_argument("--json", action="store_true", help="one JSON object per request: tokens, text, nfe, seconds")
    p.add_argument("--tensor-parallel-size", type=positive, default=None,
                   help="split the model over this many devices (attention heads, MLP, vocabulary); default 1")
    p.add_argument("--data-parallel-size", type=positive, default=None,
                   help="copies of the model, each running part of every batch; default 1")
    p.add_argument("--distributed", action="store_true",
                   help="several hosts: jax.distributed.initialize from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                        "JAX_PROCESS_ID (or SLURM / Open MPI); run the same command on every host")
    add_compile_cache(p)
    return p


def _mesh(args: argparse.Namespace) -> Mesh | None:
    """The device mesh the flags ask for (None when neither size is given: no mesh)."""
    if args.tensor_parallel_size is None and args.data_parallel_size is None:
        return None
    return make_mesh(args.tensor_parallel_size or 1, args.data_parallel_size or 1)


def _read_input(path: Path) -> tuple[str, bytes]:
    """(the name errors give it, its bytes) of --input: a file, a pipe or FIFO (`<(...)`,
    /dev/stdin), or `-` for standard input."""
    if str(path) == "-":
        return "<stdin>", sys.stdin.buffer.read()
    if path.is_dir():
        raise InputError(f"--input {path} is a directory; give a JSONL file")
    if not path.exists():
        raise InputError(f"--input {path} does not exist")
    try:
        return str(path), path.read_bytes()
    except OSError as e:
        raise InputError(f"--input {path} cannot be read: {e.strerror or e}") from None


def _parse_line(raw: bytes) -> dict[str, Any]:
    """One --input line as a request object whose keys are known and whose request keys have their
    types (decoding settings are checked by DecodeConfig)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {json.dumps(obj)[:40]}")
    unknown = sorted(set(obj) - set(REQUEST_KEYS) - set(DECODE_KEYS))
    if unknown:
        raise InputError(f"unknown keys {unknown}; known: {sorted([*REQUEST_KEYS, *DECODE_KEYS])}")
    for key, kind in REQUEST_KEYS.items():
        value = obj.get(key)
        if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise InputError(f"{key} must be {kind.__name__ if kind is not list else 'a list'}, "
                             f"got {json.dumps(value)[:40]}")
    return obj


def _lines(args: argparse.Namespace) -> list[tuple[str, dict[str, Any] | InputError]]:
    """(where, request object, or the error that makes the line none) of every request: the flags'
    one, or each non-blank line of --input."""
    if args.input is None:
        if args.prompt is None and args.prompt_ids is None:
            raise InputError("give --prompt TEXT, --prompt-ids 1,2,3 or --input FILE.jsonl")
        return [("the flags", {})]
    name, data = _read_input(args.input)
    lines: list[tuple[str, dict[str, Any] | InputError]] = []
    for n, raw in enumerate(data.removeprefix(b"\xef\xbb\xbf").splitlines(), 1):  # a UTF-8 BOM is no request
        if raw.strip():
            try:
                lines.append((f"{name}:{n}", _parse_line(raw)))
            except InputError as e:
                lines.append((f"{name}:{n}", e))
    if not lines:
        raise InputError(f"--input {name} holds no requests")
    return lines


def _field(req: dict[str, Any], args: argparse.Namespace, key: str) -> Any:
    """A request's value for `key`: its own line's, else the flag's."""
    return req[key] if key in req else getattr(args, key, None)


def _name(req: dict[str, Any], key: str) -> str:
    """How errors name `key`'s value: the line's key, or the flag it came from."""
    return key if key in req else "--" + key.replace("_", "-")


def _choose(req, args, text_key: str, ids_key: str) -> tuple[list[int] | None, str | None]:
    """(ids, None) or (None, text) for one span: the request line's own key wins over the flags,
    and between flags the ids win. A text is checked (valid Unicode, not empty)."""
    ids, text = _field(req, args, ids_key), _field(req, args, text_key)
    if ids is not None and (ids_key in req or text_key not in req):
        return token_ids(ids, ids_key), None
    if text is not None:
        check_text(text, _name(req, text_key))
        if not text:
            raise InputError(f"{_name(req, text_key)} is empty")
    return None, text


def _span(req, args, model: Model, text_key: str, ids_key: str) -> list[int] | None:
    """Token ids of a plain text span (no template, no BOS) or the given ids; None if neither."""
    ids, text = _choose(req, args, text_key, ids_key)
    if ids is not None or text is None:
        return ids
    if model.tokenizer is None:
        raise InputError(f"this model ships no tokenizer: give token ids ({ids_key})")
    return model.encode(text, chat=False, special_tokens=False)


def _encode(req: dict[str, Any], args: argparse.Namespace, model: Model) -> tuple[list[int], list[int] | None, list[int]]:
    """(prompt ids, affix ids or None, prompt tail ids) of one request. Without an affix a prompt
    text is a chat turn (unless no_chat); with one, every text is a plain span."""
    affix = _span(req, args, model, "affix", "affix_ids")
    tail = _span(req, args, model, "prompt_tail", "prompt_tail_ids") or []
    ids, text = _choose(req, args, "prompt", "prompt_ids")
    if ids is not None:
        return ids, affix, tail
    if text is None:
        raise InputError("the request has neither prompt nor prompt_ids")
    if model.tokenizer is None:
        raise InputError("this model ships no tokenizer: give token ids (--prompt-ids / prompt_ids)")
    return model.encode(text, chat=not _field(req, args, "no_chat"), special_tokens=affix is None), affix, tail


@dataclasses.dataclass
class _Job:
    """One checked request: its decoding config, its affix (ids) and its layout."""

    config: DecodeConfig
    affix: tuple[int, ...] | None
    request: Request


# Sampling settings of one family only (the other family's sampler never reads them).
FAMILY_KEYS = {"remasking": "llada", "alg": "dream", "alg_temp": "dream", "top_p": "dream", "top_k": "dream"}


def _check_settings(req: dict[str, Any], settings: dict[str, Any], affix: list[int] | None,
                    config: DecodeConfig, family: str) -> None:
    """Settings that would otherwise be dropped without a word: a factor and a threshold are two
    rules for the same choice (the factor would win), an anchor mass only shapes the anchors of
    `acache` with an affix, and a sampling setting of the other family is never read."""
    other = next((k for k in FAMILY_KEYS if k in settings and FAMILY_KEYS[k] != family), None)
    if other is not None:
        names = {"llada": "LLaDA", "dream": "Dream"}
        raise InputError(f"{_name(req, other)} is a setting of {names[FAMILY_KEYS[other]]} models' sampler; "
                         f"this model is a {names[family]} model")
    if settings.get("factor") is not None and "threshold" in settings:
        raise InputError(f"{_name(req, 'factor')} and {_name(req, 'threshold')} are two rules for which tokens a "
                         "step commits; give one")
    if settings.get("anchor_mass") is not None and (affix is None or config.cache != "acache"):
        why = "this request has no affix" if affix is None else f"the cache policy is {config.cache!r}"
        raise InputError(f"{_name(req, 'anchor_mass')} sets the anchor budget of cache acache with an affix; {why}")


def _job(model: Model, args: argparse.Namespace, flags: dict[str, Any], req: dict[str, Any]) -> _Job:
    """One request (a line's object over the flags), tokenized and checked; lengths by arithmetic
    before anything is built."""
    settings = flags | {k: req[k] for k in DECODE_KEYS if k in req}
    config = model.decode_config(**settings, attn_backend=args.backend)
    if args.engine:
        check_engine_config(config)
    prompt, affix, tail = _encode(req, args, model)
    _check_settings(req, settings, affix, config, model.config.family)
    affix = None if affix is None else check_affix(affix, model.config)
    position = _field(req, args, "affix_position")
    request = Request(prompt, tail=tail, affix_position=position or ("prefix" if affix is not None else None),
                      seed=_field(req, args, "seed"))
    try:
        check_request(request, config.gen_length, model.config, affix)
    except InputError as e:
        raise RequestError(model.name_defaults(str(e), settings)) from None
    check_policy(config, affix)
    return _Job(config, None if affix is None else tuple(affix), request)


def _jobs(model: Model, args: argparse.Namespace) -> list[_Job]:
    """Every request, checked and tokenized before any work starts. Every bad line of --input is
    reported (the first MAX_REPORTED of them, each naming its line), not just the first."""
    flags = {k: getattr(args, k) for k in DECODE_KEYS if hasattr(args, k)}
    jobs, problems = [], []
    for where, req in _lines(args):
        try:
            if isinstance(req, InputError):
                raise req
            jobs.append(_job(model, args, flags, req))
        except InputError as e:
            problems.append(f"{where}: {e}" if args.input else str(e))
    if len(problems) > MAX_REPORTED:
        problems[MAX_REPORTED:] = [f"and {len(problems) - MAX_REPORTED} more bad lines"]
    if problems:
        raise InputError("\n".join(problems))
    return jobs


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C inside the block takes effect when it ends. (Masking the signal is not enough: one
    that arrived just before the mask raises KeyboardInterrupt at the next bytecode inside.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _sigint_remembered() -> Iterator[list[int]]:
    """Ctrl-C raises KeyboardInterrupt as Python's own handler does, and is also remembered (the
    list yielded): one that lands inside a garbage-collection callback or a __del__ is printed and
    swallowed by Python ("Exception ignored in ..."), and the run would go on to its end as if
    never interrupted. The loops check the list between windows and steps (`_Output.put`,
    `_stop_if_interrupted`). A run started with SIGINT ignored (a background job) keeps ignoring it."""
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield caught
        return

    def interrupt(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_if_interrupted(caught: list[int]) -> None:
    if caught:
        raise KeyboardInterrupt


class _Output:
    """Prints results in input order as soon as each and all earlier ones are done (flushed)."""

    def __init__(self, model: Model, as_json: bool, interrupts: list[int] | None = None):
        self.model, self.as_json = model, as_json
        self.done, self._pending = 0, {}
        self.interrupts = [] if interrupts is None else interrupts  # Ctrl-Cs seen (`_sigint_remembered`)

    def put(self, i: int, row: dict[str, Any]) -> None:
        _stop_if_interrupted(self.interrupts)
        self._pending[i] = row
        while self.done in self._pending:
            with _sigint_deferred():  # no torn line, and `done` counts exactly what is out
                self._print(self._pending.pop(self.done))
                self.done += 1

    def _print(self, r: dict[str, Any]) -> None:
        if self.as_json:
            print(json.dumps(r), flush=True)
            return
        print(r["text"] if r["text"] is not None else " ".join(map(str, r["tokens"])), flush=True)
        anchors = f", anchors {r['anchors']}" if "anchors" in r else ""
        where = "engine run" if "engine" in r else f"forward tokens {r['forward_tokens']}"
        print(f"[nfe {r['nfe']}, {where}, {r['seconds']:.2f} s{anchors}]", file=sys.stderr, flush=True)


def _row(model: Model, config: DecodeConfig, tokens, nfe: int, anchors, **stats) -> dict[str, Any]:
    row = {"tokens": [int(t) for t in tokens], "text": model.answer_text(tokens), "nfe": int(nfe), **stats}
    if config.selective:
        row["anchors"] = [int(a) for a in anchors]
    return row


def _groups(jobs: list[tuple[int, _Job]]) -> dict[tuple, list[tuple[int, _Job]]]:
    groups: dict[tuple, list[tuple[int, _Job]]] = {}
    for i, job in jobs:
        groups.setdefault((job.config, job.affix), []).append((i, job))
    return groups


def _run_static(model: Model, jobs: list[_Job], batch_size: int, out: _Output) -> None:
    """Input lines in windows of a few batches; within a window, one `generate` per config and affix."""
    caches: dict[tuple[int, ...], AffixCache] = {}  # one affix cache per distinct affix
    window = WINDOW_BATCHES * batch_size
    for begin in range(0, len(jobs), window):
        for (config, affix), members in _groups(list(enumerate(jobs))[begin:begin + window]).items():
            _stop_if_interrupted(out.interrupts)
            shared = None
            if affix is not None:
                shared = caches.get(affix) if config.selective else list(affix)
                if shared is None:
                    shared = caches[affix] = build_affix_cache(model, affix)
            res = generate(model, [job.request for _, job in members], config, affix=shared, max_batch=batch_size)
            for j, (i, _) in enumerate(members):
                out.put(i, _row(model, config, res.tokens[j], res.nfe[j], res.anchors[j],
                                forward_tokens=int(res.forward_tokens[j]), seconds=round(float(res.seconds[j]), 4)))


def _run_engine(model: Model, jobs: list[_Job], args: argparse.Namespace, out: _Output) -> None:
    """One engine per `DecodeConfig.engine_key` (lines whose configs differ only in gen length or the
    sampler's numbers decode together, each with its own), stepped until its requests are done;
    results printed as they finish. The engines run in one KV pool: one made per config held the
    last one's while it was made."""
    groups: dict[DecodeConfig, list[tuple[int, _Job]]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.config.engine_key(), []).append((i, job))
    if not groups:
        return
    # no larger a batch (and so a default pool) than these requests need: a pool for 16 requests of
    # LLaDA-8B's context is 34 GB, for the one request of a --prompt run
    pool = pool_for(model, list({job.config for job in jobs}), min(args.batch_size, max(map(len, groups.values()))),
                    pool_tokens=args.pool_tokens)
    for members in groups.values():
        engine = Engine(model, members[0][1].config, max_batch=min(args.batch_size, len(members)), pool=pool)
        ids = {engine.add(job.request, job.affix, config=job.config): (i, job) for i, job in members}
        while engine.has_unfinished():
            _stop_if_interrupted(out.interrupts)
            for res in engine.step():
                i, job = ids[res.request_id]
                out.put(i, _row(model, job.config, res.tokens, res.nfe, res.anchors, forward_tokens=None,
                                seconds=round(engine.stats.seconds, 4), engine=engine.stats.summary()))
        engine.drain()  # its last requests' affix leaves the pool


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = None
    try:
        compile_cache.enable(args.compile_cache)
        if args.model is None and not DEFAULT_MODEL.is_dir():
            raise InputError("no --model given and no default model is shipped with this installation; "
                             "pass --model DIR (an HF LLaDA/Dream snapshot or a converted checkpoint)")
        if args.distributed:
            initialize_distributed()
        model = load(args.model or DEFAULT_MODEL, dtype=args.dtype, mesh=_mesh(args))
        jobs = _jobs(model, args)
        if isinstance(model.tokenizer, LazyTokenizer):  # unless the jobs' text loaded it: the answers' text needs it
            model.tokenizer.load_beside()
        with _sigint_remembered() as interrupts, compile_cache.note_long_compiles():
            out = _Output(model, args.json, interrupts)
            if args.engine:
                _run_engine(model, jobs, args, out)
            else:
                _run_static(model, jobs, args.batch_size, out)
    except InputError as e:
        for line in str(e).splitlines():  # one line per problem (every bad --input line)
            print(f"error: {line}", file=sys.stderr)
        return 2
    except BaseException as e:
        # After a Ctrl-C, what unwinds is the interrupt, whatever its type: a KeyboardInterrupt
        # raised inside Python code that C code called (numpy hashing a jax dtype) arrives as the
        # SystemError that C code raises.
        if not (isinstance(e, KeyboardInterrupt) or (out is not None and out.interrupts)):
            raise
        done = 0 if out is None else out.done
        print(f"interrupted: {done} of {len(jobs) if out else '?'} requests done (printed above)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The OpenAI request and response shapes: a checked request body becomes a `Job`, and results become
completion objects, stream chunks and error objects.

Every field is type-checked (a string is never a number, a number never a boolean); fields this
server does not know are ignored, as OpenAI clients send many. Texts are cut into pieces and each
piece is tokenized alone (`acache_jax.affix_index`), so that a span of whole pieces has the same
ids wherever it appears and can be found again by discovery.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from acache_jax.affix_index import encode_pieces
from acache_jax.config import DecodeConfig, InputError
from acache_jax.engine.engine import check_engine_config
from acache_jax.layout import AFFIX_POSITIONS, MAX_SEED, Request, check_request
from acache_jax.model import Model

# Request fields that set decoding knobs (DecodeConfig fields of the same name).
KNOBS = {"block_length": "int", "threshold": "opt number", "cache": "str", "anchor_ratio": "number",
         "temperature": "number"}
MAX_STOPS = 4  # as OpenAI


class ApiError(Exception):
    """An HTTP error with the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    """One checked, tokenized request. The prompt is `head` (pieces) and, with a declared affix,
    the affix placed at `affix_position` (infix: followed by the `tail` pieces)."""

    chat: bool
    head: list[list[int]]
    affix: tuple[int, ...] | None
    affix_position: str | None
    tail: list[list[int]]
    config: DecodeConfig  # the engine's key: the request's knobs, gen_length one block
    gen_length: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model_name: str
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.head)) + len(self.affix or ()) + sum(map(len, self.tail))

    def request(self, head: list[list[int]], affix: tuple[int, ...] | None, position: str | None,
                tail: list[list[int]]) -> Request:
        flat = lambda pieces: [t for p in pieces for t in p]
        return Request(flat(head), flat(tail), position if affix else None, self.seed)


def _get(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked against kind: int, number, bool, str, with "opt " allowing null."""
    if name not in body or (body[name] is None and not kind.startswith("opt ")):
        return default
    value, base = body[name], kind.removeprefix("opt ")
    if value is None:
        return None
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[base]
    if not ok:
        what = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string"}[base]
        raise ApiError(400, f"{name} must be {what}{' or null' * kind.startswith('opt ')}, got {value!r:.60}", name)
    return value


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def _prompt_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # lm-eval and others send one prompt as a list of one
    if isinstance(prompt, list):
        raise ApiError(400, "prompt must be one string (a list of several prompts is not supported)", "prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", "prompt")
    return prompt


def _chat_text(body: dict[str, Any], model: Model) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ApiError(400, f"messages[{i}] must be an object with string role and content", "messages")
        if m["role"] not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be system, user or assistant, got {m['role']!r:.30}",
                           "messages")
    tok = model.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
    clean = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)


def engine_config(base: DecodeConfig, **knobs: Any) -> DecodeConfig:
    """The engine a request with these knobs runs on: one engine per distinct decoding setting, and
    gen length is per request (rounded up to whole blocks), so the key holds one block."""
    block = knobs.get("block_length", base.block_length)
    if not isinstance(block, int) or block <= 0:
        raise InputError(f"block_length must be a positive integer, got {block!r}")
    steps = None if base.steps is None else base.steps_per_block
    config = base.replace(**knobs, gen_length=block, steps=steps)
    check_engine_config(config)
    return config


def parse(body: Any, model: Model, base: DecodeConfig, served_name: str, chat: bool) -> Job:
    """A checked, tokenized Job from a request body (ApiError for anything wrong with it)."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    name = _get(body, "model", "str", served_name)
    if name != served_name:
        raise ApiError(404, f"the model {name!r:.80} does not exist; this server serves {served_name!r}", "model",
                       "model_not_found")
    if _get(body, "n", "int", 1) != 1:
        raise ApiError(400, "n must be 1 (one completion per request)", "n")
    if body.get("logprobs") not in (None, False) or body.get("echo") not in (None, False):
        raise ApiError(400, "logprobs and echo are not supported", "logprobs" if body.get("logprobs") else "echo")
    stream = _get(body, "stream", "bool", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    include_usage = _get(options, "include_usage", "bool", False)
    seed = _get(body, "seed", "int", 0)
    if not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"seed must be in [0, {MAX_SEED}], got {seed}", "seed")
    knobs = {k: _get(body, k, kind) for k, kind in KNOBS.items() if k in body and (body[k] is not None or
                                                                                  kind.startswith("opt "))}
    limit = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _get(body, limit, "int", None)
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(400, f"{limit} must be positive, got {max_tokens}", limit)
    try:
        config = engine_config(base, **knobs)
    except InputError as e:
        raise ApiError(400, str(e), next((k for k in knobs if k in str(e)), None)) from None
    block = config.block_length
    gen_length = -(-(max_tokens or base.gen_length) // block) * block
    affix_text = _get(body, "affix", "str")
    position = _get(body, "affix_position", "str")
    suffix = _get(body, "suffix", "str") if not chat else None
    tail_text = _get(body, "prompt_tail", "str") if not chat else None
    if position is not None and position not in AFFIX_POSITIONS:
        raise ApiError(400, f"affix_position must be one of {AFFIX_POSITIONS}, got {position!r:.30}", "affix_position")
    if position is not None and affix_text is None:
        raise ApiError(400, "affix_position given without an affix", "affix_position")
    if suffix and affix_text is not None:
        raise ApiError(400, "give either suffix or affix (one affix per request; a suffix is one)", "suffix")
    position = (position or "prefix") if affix_text is not None else ("suffix" if suffix else None)
    if (position == "infix") != bool(tail_text):
        raise ApiError(400, "an infix affix needs a prompt_tail after it, and prompt_tail is only for one",
                       "prompt_tail")
    if chat and position == "infix":
        raise ApiError(400, "chat requests take a prefix or suffix affix", "affix_position")
    if model.tokenizer is None:
        raise ApiError(400, "this model ships no tokenizer")
    text = _chat_text(body, model) if chat else _prompt_text(body)
    specials = [t for t in model.tokenizer.all_special_tokens if t]
    encode = lambda s: model.encode(s, chat=False, special_tokens=False)
    pieces = lambda s: encode_pieces(s, encode, specials) if s else []
    affix = affix_text if affix_text is not None else suffix
    affix_ids = tuple(t for p in pieces(affix) for t in p) if affix else None
    if affix is not None and not affix_ids:
        raise ApiError(400, "the affix is empty", "affix")
    job = Job(chat, pieces(text), affix_ids, position, pieces(tail_text), config, gen_length, seed, _stops(body),
              stream, include_usage, served_name)
    try:
        check_request(job.request(job.head, job.affix, position, job.tail), gen_length, model.config,
                      list(affix_ids) if affix_ids else None)
    except InputError as e:
        raise ApiError(400, str(e), limit if "exceeds the model's context" in str(e) else None) from None
    return job


@dataclasses.dataclass
class Answer:
    """A finished request, as the worker reports it."""

    text: str
    finish_reason: str  # "stop" (an end-of-text token or a stop string) | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    extra: dict[str, Any]  # acache details: the affix used, where it came from, anchors, NFE, answer ids


def usage(answer: Answer) -> dict[str, Any]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}}


def _choice(job: Job, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
    if job.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}


def completion(job: Job, answer: Answer) -> dict[str, Any]:
    """The whole response of a request that does not stream."""
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text},
                  "finish_reason": answer.finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": answer.text, "finish_reason": answer.finish_reason, "logprobs": None}
    return {"id": _id(job), "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
            "model": job.model_name, "choices": [choice], "usage": usage(answer), "acache": answer.extra}


def chunk(job: Job, text: str | None, finish: str | None = None, first: bool = False,
          answer: Answer | None = None) -> dict[str, Any]:
    """One stream chunk: new text and/or the finish reason (with usage and details on the last)."""
    out = {"id": _id(job), "object": "chat.completion.chunk" if job.chat else "text_completion",
           "created": job.created, "model": job.model_name, "choices": [_choice(job, text, finish, first)]}
    if answer is not None:
        out["acache"] = answer.extra
        if job.include_usage:
            out["usage"] = usage(answer)
    return out


def _id(job: Job) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + job.id

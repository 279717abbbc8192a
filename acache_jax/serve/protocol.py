"""The OpenAI request and response shapes: a checked request body becomes a `Job`, and results become
completion objects, stream chunks and error objects.

Every field is type-checked (a string is never a number, a number never a boolean). A field this
server does not know is refused with a 400 that names it, so a misspelt knob is never silently
ignored; OpenAI's fields that have no effect here are taken at their neutral values (`NEUTRAL`).
Every string in the body must be Unicode text (a lone surrogate, "\\ud800" in JSON, is a 400 naming
its field). Lengths are checked by arithmetic before anything grows with them: `max_tokens` against
the model's context before tokenizing, and the prompt while it is tokenized, which stops at the first
piece past what the context leaves. Texts are cut into pieces and each piece is tokenized alone
(`acache_jax.serve.affix_index`), so that a span of whole pieces has the same ids wherever it appears and
can be found again by discovery.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

from jinja2 import TemplateError

from acache_jax.decoding.layout import AFFIX_POSITIONS, MAX_SEED, Request, check_request, round_up
from acache_jax.engine.engine import check_engine_config
from acache_jax.network.config import FIELD_KINDS, DecodeConfig, InputError
from acache_jax.network.model import Model, check_text
from acache_jax.serve.affix_index import split_text

# Request fields that set decoding knobs (DecodeConfig fields of the same name): those the engine
# runs for every model family, with their fields' kinds (a JSON number where the field is a float).
KNOBS = {k: FIELD_KINDS[k].replace("float", "number") for k in (
    "block_length", "threshold", "factor", "cache", "anchor_ratio", "anchor_mass", "anchor_min_ratio", "selector",
    "temperature")}
# OpenAI fields with no counterpart here, taken only at the values that ask for nothing (clients such
# as LangChain send them with their defaults); `user` is a caller's tag and never changes an answer.
NEUTRAL = {"top_p": (1,), "frequency_penalty": (0,), "presence_penalty": (0,), "best_of": (1,), "logit_bias": ({},),
           "top_logprobs": (0,)}
FIELDS = {"model", "n", "stream", "stream_options", "seed", "stop", "max_tokens", "logprobs", "echo", "user",
          "affix", "affix_position", *KNOBS, *NEUTRAL}
COMPLETION_FIELDS = FIELDS | {"prompt", "suffix", "prompt_tail"}
CHAT_FIELDS = FIELDS | {"messages", "max_completion_tokens"}
MAX_STOPS = 4  # as OpenAI


class ApiError(Exception):
    """An HTTP error with the OpenAI error object's fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        message, param = _utf8(message), None if param is None else _utf8(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error"}.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _utf8(text: str) -> str:
    """`text` with any lone surrogate (a client's text quoted in an error) written as an escape: an
    error object must always encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclasses.dataclass
class Job:
    """One checked, tokenized request. The prompt is `head` (pieces) and, with a declared affix,
    the affix placed at `affix_position` (infix: followed by the `tail` pieces)."""

    chat: bool
    head: list[list[int]]
    affix: tuple[int, ...] | None
    affix_position: str | None
    tail: list[list[int]]
    config: DecodeConfig  # the request's knobs, gen_length one block (its engine: its `engine_key`)
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

    def settings(self) -> dict[str, Any]:
        """What the request runs with (each response's `acache.settings`): every knob, given or the
        server's default, and `max_tokens` as run (rounded up to whole blocks)."""
        return {k: getattr(self.config, k) for k in KNOBS} | {"max_tokens": self.gen_length}

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


def _check_text(body: dict[str, Any]) -> None:
    """A 400 naming the first string (or key) of the body that is not Unicode text: JSON can carry a
    lone surrogate ("\\ud800"), which neither the tokenizer nor a UTF-8 response can take. Walked
    without recursion, whatever the nesting."""
    todo: list[tuple[str | None, str, Any]] = [(k, k, v) for k, v in body.items()]
    todo += [(None, "a field name", k) for k in body]  # popped first: a path may then quote a name
    while todo:
        field, path, value = todo.pop()
        if isinstance(value, str):
            try:
                check_text(value, path)  # the library's one test of what the tokenizer can take
            except InputError as e:
                raise ApiError(400, str(e), field) from None
        elif isinstance(value, dict):
            todo += [(field, f"{path}.{k}", v) for k, v in value.items()] + [(field, f"a key of {path}", k) for k in value]
        elif isinstance(value, list):
            todo += [(field, f"{path}[{i}]", v) for i, v in enumerate(value)]


def _check_fields(body: dict[str, Any], chat: bool) -> None:
    """A 400 naming every field this endpoint does not take, and every OpenAI field set to a value
    that would ask for something this server does not do."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        other = COMPLETION_FIELDS if chat else CHAT_FIELDS
        where = [k for k in unknown if k in other]
        hint = (f" ({', '.join(where)} {'is' if len(where) == 1 else 'are'} for "
                f"{'/v1/completions' if chat else '/v1/chat/completions'})") if where else ""
        raise ApiError(400, f"unknown field{'s' * (len(unknown) > 1)} {', '.join(unknown)}{hint}; this endpoint "
                            f"takes {', '.join(sorted(known))}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in neutral:
            raise ApiError(400, f"{name} is not supported (only {neutral[0]!r} or null), got {body[name]!r:.40}", name)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise ApiError(400, "user must be a string", "user")


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
    try:
        return tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
    except TemplateError as e:  # the template refuses this conversation (e.g. roles that do not alternate)
        raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages") from None


class _Pieces:
    """Texts as pieces of token ids (`affix_index.split_text`, each piece tokenized alone, empty ones
    dropped) against the prompt tokens the context has room for: tokenizing stops at the first
    piece past `room`, so a prompt far longer than the context costs about one context of work, and
    a piece that recurs (a line of blanks a million times) is tokenized once."""

    def __init__(self, model: Model, room: int, too_long: str):
        self.model, self.room, self.too_long = model, room, too_long
        self.specials = [t for t in model.tokenizer.all_special_tokens if t]
        self.seen: dict[str, list[int]] = {}

    def __call__(self, text: str | None, field: str) -> list[list[int]]:
        out = []
        for piece in split_text(text or "", self.specials):
            ids = self.seen.get(piece)
            if ids is None:
                ids = self.seen[piece] = self.model.encode(piece, chat=False, special_tokens=False)
            if ids:
                self.room -= len(ids)
                if self.room < 0:
                    raise ApiError(400, self.too_long, field)
                out.append(list(ids))
        return out


def engine_config(base: DecodeConfig, **knobs: Any) -> DecodeConfig:
    """The config a request with these knobs runs with (its engine is the one of its
    `engine_key`), at one block: gen length is per request (rounded up to whole blocks)."""
    block = knobs.get("block_length", base.block_length)
    if not isinstance(block, int) or block <= 0:
        raise InputError(f"block_length must be a positive integer, got {block!r}")
    config = base.with_gen_length(base.block_length).replace(**knobs, gen_length=block)
    check_engine_config(config)
    return config


def _room(model: Model, block: int, gen_length: int, given: int | None, limit: str, max_model_len: int | None,
          max_prompt_tokens: int | None) -> tuple[int, str]:
    """(the prompt tokens a request generating `gen_length` has room for, the end of the 400 for a
    prompt that needs more), by arithmetic on the numbers: nothing of any of these lengths is built.
    The context is the model's, or the server's smaller `--max-model-len`."""
    model_context = model.config.max_seq_len
    context = min(model_context, max_model_len or model_context)
    where = (f"the model's context of {context} tokens" if context == model_context else
             f"this server's limit of {context} tokens (--max-model-len; the model's context is {model_context})")
    if gen_length >= context:
        most = (context - 1) // block * block
        if not most:
            raise ApiError(400, f"block_length {block} leaves no room for a prompt in {where}", "block_length")
        raise ApiError(400, f"{limit} {given} ({gen_length} in whole blocks of {block}) leaves no room for a prompt "
                            f"in {where}; at most {most}", limit)
    room = context - gen_length
    if max_prompt_tokens is not None and max_prompt_tokens < room:
        return max_prompt_tokens, f"more than {max_prompt_tokens} tokens, this server's limit (--max-prompt-tokens)"
    return room, (f"more than the {room} tokens {where} leaves beside the {gen_length} generated ({limit}, rounded "
                  f"up to whole blocks of {block})")


def parse(body: Any, model: Model, base: DecodeConfig, served_name: str, chat: bool, max_model_len: int | None = None,
          max_prompt_tokens: int | None = None) -> Job:
    """A checked, tokenized Job from a request body (ApiError for anything wrong with it). Every
    check that costs nothing comes before tokenizing, and tokenizing stops where the context (or
    the server's `max_model_len` / `max_prompt_tokens`) ends."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_text(body)
    _check_fields(body, chat)
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
    if set(options) - {"include_usage"}:
        raise ApiError(400, f"unknown stream_options field(s) {sorted(set(options) - {'include_usage'})}; "
                            "known: include_usage", "stream_options")
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
        message = str(e)
        named = [k for k in knobs if k in message or k.replace("_", " ") in message]
        raise ApiError(400, message, (named or list(knobs) or [None])[0]) from None
    block = config.block_length
    gen_length = round_up(max_tokens or base.gen_length, block)
    room, too_long = _room(model, block, gen_length, max_tokens or base.gen_length, limit, max_model_len,
                           max_prompt_tokens)
    affix_text = _get(body, "affix", "str")
    position = _get(body, "affix_position", "str")
    suffix = _get(body, "suffix", "str") if not chat else None
    tail_text = _get(body, "prompt_tail", "str") if not chat else None
    if position is not None and position not in AFFIX_POSITIONS:
        raise ApiError(400, f"affix_position must be one of {AFFIX_POSITIONS}, got {position!r:.30}", "affix_position")
    if position is not None and affix_text is None:
        raise ApiError(400, "affix_position given without an affix", "affix_position")
    if chat and position == "infix":
        raise ApiError(400, "chat requests take a prefix or suffix affix (an infix affix needs a prompt_tail, "
                            "which only /v1/completions takes)", "affix_position")
    if suffix and affix_text is not None:
        raise ApiError(400, "give either suffix or affix (one affix per request; a suffix is one)", "suffix")
    position = (position or "prefix") if affix_text is not None else ("suffix" if suffix else None)
    if (position == "infix") != bool(tail_text):
        raise ApiError(400, "an infix affix needs a prompt_tail after it, and prompt_tail is only for one",
                       "prompt_tail")
    if model.tokenizer is None:
        raise ApiError(400, "this model ships no tokenizer")
    text = _chat_text(body, model) if chat else _prompt_text(body)
    pieces = _Pieces(model, room, f"the prompt{' and affix hold' if position else ' holds'} {too_long}")
    head = pieces(text, "messages" if chat else "prompt")
    affix = affix_text if affix_text is not None else suffix
    affix_ids = tuple(t for p in pieces(affix, "affix" if affix_text is not None else "suffix") for t in p) or None
    if affix is not None and not affix_ids:
        raise ApiError(400, "the affix is empty", "affix")
    job = Job(chat, head, affix_ids, position, pieces(tail_text, "prompt_tail"), config, gen_length, seed,
              _stops(body), stream, include_usage, served_name)
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
            "model": job.model_name, "choices": [choice], "usage": usage(answer), "acache": _details(job, answer)}


def chunk(job: Job, text: str | None, finish: str | None = None, first: bool = False,
          answer: Answer | None = None) -> dict[str, Any]:
    """One stream chunk: new text and/or the finish reason (with usage and details on the last)."""
    out = {"id": _id(job), "object": "chat.completion.chunk" if job.chat else "text_completion",
           "created": job.created, "model": job.model_name, "choices": [_choice(job, text, finish, first)]}
    if answer is not None:
        out["acache"] = _details(job, answer)
        if job.include_usage:
            out["usage"] = usage(answer)
    return out


def _details(job: Job, answer: Answer) -> dict[str, Any]:
    """The response's `acache` object: what the engine reports, and the settings it ran with."""
    return answer.extra | {"settings": job.settings()}


def _id(job: Job) -> str:
    return ("chatcmpl-" if job.chat else "cmpl-") + job.id

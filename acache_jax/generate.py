"""Command line: `python -m acache_jax.generate --prompt "..."` (see --help).

Requests come from --prompt / --prompt-ids, or one per line of --input FILE.jsonl, where each line is
an object whose keys are the flag names without dashes (`-` as `_`) and override the flags for that
request. Requests with equal decoding settings and affix are batched; output lines keep input order.

A shared affix (--affix TEXT or --affix-ids) is placed as prefix ([affix][prompt]), infix
([prompt][affix][prompt tail]) or suffix ([prompt][generation][affix]). With an affix, texts are
tokenized as plain spans (no chat template, no BOS) so that the pieces join exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from acache_jax.attention import ATTENTION_BACKENDS
from acache_jax.acache import SELECTORS, build_affix_cache
from acache_jax.checkpoint import load
from acache_jax.config import ConfigError
from acache_jax.decode import CACHE_POLICIES, DecodeConfig, DecodeError, generate
from acache_jax.engine import Engine
from acache_jax.layout import AFFIX_POSITIONS, Request, RequestError

# The shipped LLaDA-architecture model (acache_jax/models/README.md); used when --model is not given.
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "llada-small"
STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")
# Per-request keys of --input lines that map onto DecodeConfig fields.
DECODE_KEYS = {"gen_length", "block_length", "steps", "threshold", "factor", "temperature", "cache",
               "anchor_ratio", "selector", "drop_non_anchor"}
TEXT_KEYS = {"prompt", "prompt_ids", "affix", "affix_ids", "prompt_tail", "prompt_tail_ids"}
REQUEST_KEYS = TEXT_KEYS | {"seed", "no_chat", "affix_position"} | DECODE_KEYS


def _threshold(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m acache_jax.generate", description=__doc__.splitlines()[0])
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
    p.add_argument("--affix-position", choices=AFFIX_POSITIONS, default="prefix")
    tail = p.add_mutually_exclusive_group()
    tail.add_argument("--prompt-tail", help="infix: the prompt text after the affix")
    tail.add_argument("--prompt-tail-ids", type=_ids, help="infix: the prompt token ids after the affix")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="fixed-schedule steps (default: gen length)")
    p.add_argument("--threshold", type=_threshold, default=0.9, help="confidence threshold, or 'none' for the schedule")
    p.add_argument("--factor", type=float, default=None, help="Fast-dLLM factor rule instead of the threshold")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--cache", choices=CACHE_POLICIES, default="dual",
                   help="none | prefix | dual (Fast-dLLM) | acache (anchors recomputed) | direct (affix cache as is)")
    p.add_argument("--anchor-ratio", type=float, default=0.2, help="acache: anchors per affix token")
    p.add_argument("--selector", choices=SELECTORS, default="attention", help="acache: how anchors are chosen")
    p.add_argument("--drop-non-anchor", action="store_true", help="acache DropNA ablation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="largest batch to run at once")
    p.add_argument("--backend", default=None, choices=ATTENTION_BACKENDS,
                   help="attention backend (default: pallas on a GPU, else xla)")
    p.add_argument("--engine", action="store_true",
                   help="serve the requests with the continuous-batching engine (cache dual, acache or direct)")
    p.add_argument("--pool-tokens", type=int, default=None,
                   help="engine: KV pool size in tokens (default: batch size x the model's context)")
    p.add_argument("--json", action="store_true", help="one JSON object per request: tokens, text, nfe, seconds")
    return p


def _requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.input is None:
        if args.prompt is None and args.prompt_ids is None:
            raise DecodeError("give --prompt TEXT, --prompt-ids 1,2,3 or --input FILE.jsonl")
        return [{}]
    lines = []
    for n, line in enumerate(args.input.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DecodeError(f"{args.input}:{n}: not valid JSON ({e})") from None
        unknown = set(obj) - REQUEST_KEYS
        if not isinstance(obj, dict) or unknown:
            raise DecodeError(f"{args.input}:{n}: expected an object with keys from {sorted(REQUEST_KEYS)}; "
                              f"unknown: {sorted(unknown)}")
        lines.append(obj)
    return lines


def _field(req: dict[str, Any], args: argparse.Namespace, key: str) -> Any:
    """A request's value for `key`: its own line's, else the flag's."""
    return req[key] if key in req else getattr(args, key)


def _choose(req, args, text_key: str, ids_key: str) -> tuple[list[int] | None, str | None]:
    """(ids, None) or (None, text) for one span: the request line's own key wins over the flags,
    and between flags the ids win."""
    ids, text = _field(req, args, ids_key), _field(req, args, text_key)
    if ids is not None and (ids_key in req or text_key not in req):
        return [int(t) for t in ids], None
    return None, text


def _span(req, args, tokenizer, text_key: str, ids_key: str) -> list[int] | None:
    """Token ids of a plain text span (no template, no BOS) or the given ids; None if neither."""
    ids, text = _choose(req, args, text_key, ids_key)
    if ids is not None or text is None:
        return ids
    if tokenizer is None:
        raise DecodeError(f"this model ships no tokenizer: give token ids ({ids_key})")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode(req: dict[str, Any], args: argparse.Namespace, tokenizer: Any) -> tuple[list[int], list[int] | None, list[int]]:
    """(prompt ids, affix ids or None, prompt tail ids) of one request."""
    affix = _span(req, args, tokenizer, "affix", "affix_ids")
    tail = _span(req, args, tokenizer, "prompt_tail", "prompt_tail_ids") or []
    ids, text = _choose(req, args, "prompt", "prompt_ids")
    if ids is not None:
        return ids, affix, tail
    if text is None:
        raise DecodeError("a request has neither prompt nor prompt_ids")
    if tokenizer is None:
        raise DecodeError("this model ships no tokenizer: give token ids (--prompt-ids / prompt_ids)")
    if affix is None and not _field(req, args, "no_chat") and getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)), affix, tail
    return tokenizer(text, add_special_tokens=affix is None)["input_ids"], affix, tail


def _stop_ids(model) -> set[int]:
    stops = {model.config.eos_token_id}
    tok = model.tokenizer
    if tok is not None:
        vocab = tok.get_vocab()
        stops |= {vocab[t] for t in STOP_TOKENS if t in vocab}
    return stops


def _text(tokens: np.ndarray, model, stops: set[int]) -> str | None:
    if model.tokenizer is None:
        return None
    ids = tokens.tolist()
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return model.tokenizer.decode([t for t in ids[:end] if t != model.config.mask_token_id], skip_special_tokens=True)


def _serve(model, groups: dict[tuple, list[tuple[int, Request]]], args: argparse.Namespace,
           results: list[dict[str, Any]], stops: set[int]) -> None:
    """Run every request through one engine per decoding config; engine stats go with each result."""
    engines: dict[DecodeConfig, tuple[Engine, dict[int, int]]] = {}
    for (config, affix), members in groups.items():
        if config not in engines:
            engines[config] = (Engine(model, config, pool_tokens=args.pool_tokens, max_batch=args.batch_size), {})
        engine, ids = engines[config]
        for i, request in members:
            ids[engine.add(request, affix)] = i
    for config, (engine, ids) in engines.items():
        for res in engine.run(progress=len(ids) > args.batch_size):
            i = ids[res.request_id]
            results[i] = {"tokens": res.tokens.tolist(), "text": _text(res.tokens, model, stops), "nfe": res.nfe,
                          "forward_tokens": None, "seconds": round(engine.stats.seconds, 4),
                          "engine": engine.stats.summary()}
            if config.selective:
                results[i]["anchors"] = res.anchors.tolist()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        path = args.model or DEFAULT_MODEL
        if args.model is None and not DEFAULT_MODEL.is_dir():
            raise DecodeError("no --model given and no default model is shipped with this installation; "
                              "pass --model DIR (an HF LLaDA/Dream snapshot or a converted checkpoint)")
        model = load(path, dtype=args.dtype)
        reqs = _requests(args)
        groups: dict[tuple, list[tuple[int, Request]]] = {}
        for i, req in enumerate(reqs):
            config = DecodeConfig(**{k: _field(req, args, k) for k in DECODE_KEYS}, attn_backend=args.backend)
            config.validate()
            prompt, affix, tail = _encode(req, args, model.tokenizer)
            position = _field(req, args, "affix_position") if affix is not None else None
            request = Request(prompt, tail=tail, affix_position=position, seed=_field(req, args, "seed"))
            groups.setdefault((config, None if affix is None else tuple(affix)), []).append((i, request))
        results: list[dict[str, Any]] = [{} for _ in reqs]
        stops = _stop_ids(model)
        if args.engine:
            _serve(model, groups, args, results, stops)
            groups = {}
        caches: dict[tuple[int, ...], Any] = {}  # one affix cache per distinct affix, shared by its groups
        for (config, affix), members in groups.items():
            shared = None
            if affix is not None:
                shared = caches.get(affix) if config.selective else list(affix)
                if shared is None:
                    shared = caches[affix] = build_affix_cache(model, affix)
            out = generate(model, [r for _, r in members], config, affix=shared, max_batch=args.batch_size,
                           progress=len(members) > args.batch_size)
            for j, (i, _) in enumerate(members):
                results[i] = {"tokens": out.tokens[j].tolist(), "text": _text(out.tokens[j], model, stops),
                              "nfe": int(out.nfe[j]), "forward_tokens": int(out.forward_tokens[j]),
                              "seconds": round(float(out.seconds[j]), 4)}
                if config.selective:
                    results[i]["anchors"] = out.anchors[j].tolist()
    except (RequestError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            shown = r["text"] if r["text"] is not None else " ".join(map(str, r["tokens"]))
            anchors = f", anchors {r['anchors']}" if "anchors" in r else ""
            where = "engine run" if "engine" in r else f"forward tokens {r['forward_tokens']}"
            print(f"{shown}\n[nfe {r['nfe']}, {where}, {r['seconds']:.2f} s{anchors}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

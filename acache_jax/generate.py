"""Command line: `python -m acache_jax.generate --prompt "..."` (see --help).

Requests come from --prompt / --prompt-ids, or one per line of --input FILE.jsonl, where each line is
an object whose keys are the flag names without dashes (`-` as `_`) and override the flags for that
request. Requests with equal decoding settings are batched; output lines keep input order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from acache_jax.checkpoint import load
from acache_jax.config import ConfigError
from acache_jax.decode import CACHE_POLICIES, DecodeConfig, DecodeError, generate
from acache_jax.layout import Request, RequestError

# Where a shipped default model would live; used when --model is not given.
DEFAULT_MODEL = Path(__file__).resolve().parent / "default_model"
STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>")
# Per-request keys of --input lines that map onto DecodeConfig fields.
DECODE_KEYS = {"gen_length", "block_length", "steps", "threshold", "factor", "temperature", "cache"}
REQUEST_KEYS = {"prompt", "prompt_ids", "seed", "no_chat"} | DECODE_KEYS


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
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="fixed-schedule steps (default: gen length)")
    p.add_argument("--threshold", type=_threshold, default=0.9, help="confidence threshold, or 'none' for the schedule")
    p.add_argument("--factor", type=float, default=None, help="Fast-dLLM factor rule instead of the threshold")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--cache", choices=CACHE_POLICIES, default="dual")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="largest batch to run at once")
    p.add_argument("--backend", default="xla", choices=["xla", "cudnn"], help="attention backend")
    p.add_argument("--json", action="store_true", help="one JSON object per request: tokens, text, nfe, seconds")
    return p


def _requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.input is None:
        if args.prompt is None and args.prompt_ids is None:
            raise DecodeError("give --prompt TEXT, --prompt-ids 1,2,3 or --input FILE.jsonl")
        return [{"prompt": args.prompt, "prompt_ids": args.prompt_ids}]
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


def _encode(req: dict[str, Any], args: argparse.Namespace, tokenizer: Any) -> list[int]:
    if req.get("prompt_ids") is not None:
        return [int(t) for t in req["prompt_ids"]]
    text = req.get("prompt")
    if text is None:
        raise DecodeError("a request has neither prompt nor prompt_ids")
    if tokenizer is None:
        raise DecodeError("this model ships no tokenizer: give token ids (--prompt-ids / prompt_ids)")
    if not req.get("no_chat", args.no_chat) and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(text)["input_ids"]


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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        path = args.model or DEFAULT_MODEL
        if args.model is None and not DEFAULT_MODEL.is_dir():
            raise DecodeError("no --model given and no default model is shipped with this installation; "
                              "pass --model DIR (an HF LLaDA/Dream snapshot or a converted checkpoint)")
        model = load(path, dtype=args.dtype)
        reqs = _requests(args)
        base = {k: getattr(args, k) for k in DECODE_KEYS}
        groups: dict[DecodeConfig, list[tuple[int, Request]]] = {}
        for i, req in enumerate(reqs):
            settings = {**base, **{k: req[k] for k in DECODE_KEYS if k in req}}
            config = DecodeConfig(**settings, attn_backend=args.backend)
            config.validate()
            request = Request(_encode(req, args, model.tokenizer), seed=req.get("seed", args.seed))
            groups.setdefault(config, []).append((i, request))
        results: list[dict[str, Any]] = [{} for _ in reqs]
        stops = _stop_ids(model)
        for config, members in groups.items():
            out = generate(model, [r for _, r in members], config, max_batch=args.batch_size,
                           progress=len(members) > args.batch_size)
            for j, (i, _) in enumerate(members):
                results[i] = {"tokens": out.tokens[j].tolist(), "text": _text(out.tokens[j], model, stops),
                              "nfe": int(out.nfe[j]), "forward_tokens": int(out.forward_tokens[j]),
                              "seconds": round(float(out.seconds[j]), 4)}
    except (RequestError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            shown = r["text"] if r["text"] is not None else " ".join(map(str, r["tokens"]))
            print(f"{shown}\n[nfe {r['nfe']}, forward tokens {r['forward_tokens']}, {r['seconds']:.2f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""lm-evaluation-harness adapter: any LLaDA/Dream model, with every cache policy, scored by lm-eval.

    python -m acache_jax.lm_eval --model acache_jax --model_args pretrained=DIR,cache=dual --tasks T \
        --include_path eval/lm_eval_tasks [every other flag of lm_eval]

`python -m acache_jax.lm_eval` is lm-eval's own command line with this model registered as
`acache_jax` (lm-eval finds a third-party model only once it is imported); `ACacheLM` is the
`lm_eval.api.model.LM` subclass, for `lm_eval.simple_evaluate(model=ACacheLM(...))`.

Model args (`--model_args key=value,...`; text is converted by each setting's type):
- pretrained (an HF snapshot or converted directory; default the shipped llada-small), dtype
  (float32 | bfloat16 | auto: as stored);
- every `DecodeConfig` field (cache, gen_length, block_length, threshold, steps, anchor_ratio,
  selector, drop_non_anchor, ...): the model's generation defaults, overridden by these;
- engine (serve generation with the continuous-batching `Engine`; pool_tokens: its KV pool),
  batch_size (requests decoded together, and loglikelihood rows per forward; lm-eval's
  --batch_size when not given here);
- mc_num: loglikelihood samples per request (in stratified groups of min(batch_size, mc_num));
- chat (default true): prompts are a user turn of the model's chat template; seed: the request of
  document d decodes with seed + d, and loglikelihood masks are drawn from seed;
- compile_cache: a directory or off, where compiled programs are kept for later runs (default:
  ACACHE_JAX_COMPILE_CACHE, else the user's cache directory; acache_jax/compile_cache.py);
- affix mode (the paper's accuracy study): affix_mode=prefix|infix|suffix, num_fewshot_affix=N,
  fewshot_seed (default: the first N few-shot documents; else N drawn with this seed),
  include_path (where the tasks' YAMLs are; `python -m acache_jax.lm_eval` passes its
  --include_path on). Per task, the N examples come from the task's few-shot split, are
  serialized once as the shared affix (paper appendix A, with the chat template) and, for
  cache=acache/direct, computed once into an affix cache that every request reuses. Each request
  is laid out from its document's fields: `query` (Qry), and for infix `query_head` and
  `answer_prompt` (Ans); examples use `query` and `shot_answer`. Run lm-eval with --num_fewshot 0.
- lm-eval's device, max_batch_size and trust_remote_code are accepted and ignored.
Bad model args end with one `InputError` naming the setting before any work starts.

generate_until decodes in batches (`acache_jax.decoding.decode.generate`, or the engine), each as long as
the task's max_gen_toks rounded up to whole blocks (an explicit gen_length sets it instead), and cuts
the text at the first end-of-text id, after max_gen_toks tokens and at every `until` string. loglikelihood
is the masked-diffusion Monte-Carlo estimate of LLaDA's evaluation (`acache_jax.lm_eval.likelihood`);
is_greedy is always False, as there. loglikelihood_rolling is not defined for these models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from acache_jax import compile_cache
from acache_jax.cli import DEFAULT_MODEL
from acache_jax.decoding.acache import build_affix_cache
from acache_jax.decoding.decode import generate
from acache_jax.decoding.layout import AFFIX_POSITIONS, MAX_SEED, Request, check_context, check_request
from acache_jax.engine import Engine
from acache_jax.engine.engine import check_engine_config, pool_for
from acache_jax.engine.pool import PagedPool
from acache_jax.lm_eval import chat_layout, likelihood
from acache_jax.network.checkpoint import DTYPES, load
from acache_jax.network.config import (FIELD_KINDS, GENERATION_CONFIG_FILE, DecodeConfig, DecodeError, InputError,
                                       ModelConfig, name_defaults, read_generation_config)
from acache_jax.network.kv import AffixCache

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # the lm-eval extra is not installed
    # named as this module's failure: `python -m acache_jax.lm_eval` then ends with this one line
    raise ImportError("acache_jax.lm_eval needs lm-eval: pip install 'acache-jax[lm-eval]'", name=__name__) from e

log = logging.getLogger(__name__)
MODEL_NAME = "acache_jax"
# The adapter's own model args and their types (DecodeConfig fields come from config.FIELD_KINDS).
ADAPTER_KINDS = {
    "pretrained": "opt str", "dtype": "opt str", "engine": "bool", "batch_size": "batch", "mc_num": "int",
    "chat": "bool", "seed": "int", "affix_mode": "opt str", "num_fewshot_affix": "int", "fewshot_seed": "opt int",
    "include_path": "opt str", "pool_tokens": "opt int", "compile_cache": "opt str",
}
IGNORED = ("device", "max_batch_size", "trust_remote_code")  # lm-eval passes these to every model
DEFAULT_BATCH = 16
SHOT_FIELDS = ("query", "shot_answer")  # a few-shot document's fields; a request's: (infix?) -> fields
REQUEST_FIELDS = {False: ("query",), True: ("query", "query_head", "answer_prompt")}


def _convert(name: str, value: Any, kind: str) -> Any:
    """`value` (text from the command line, or already typed by lm-eval) as `kind`; InputError if not."""
    base = kind.removeprefix("opt ")
    text = value.strip().lower() if isinstance(value, str) else None
    if kind.startswith("opt ") and (value is None or text in ("none", "null")):
        return None
    if base == "batch" and text is not None and text.startswith("auto"):
        return None  # lm-eval's automatic batch size: ours
    wanted = {"int": "an integer", "batch": "a positive integer or auto", "float": "a number",
              "bool": "true or false", "str": "text"}[base]
    try:
        if base == "str":
            return str(value)
        if base == "bool":
            table = {"true": True, "1": True, "false": False, "0": False}
            if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
                return bool(value)
            return table[text]
        if base in ("int", "batch"):
            if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
                return int(value)
            if isinstance(value, float) and value.is_integer():
                return int(value)  # lm-eval reads "-1" as a float
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise ValueError
        number = float(value) if isinstance(value, str) else value
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ValueError
        return number
    except (KeyError, ValueError):
        raise InputError(f"model_args: {name} must be {wanted}{' or none' * kind.startswith('opt ')}, "
                         f"got {value!r}") from None


def parse_model_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter settings, DecodeConfig overrides), converted and type-checked; unknown keys are an error."""
    unknown = sorted(set(args) - set(ADAPTER_KINDS) - set(FIELD_KINDS) - set(IGNORED))
    if unknown:
        raise InputError(f"model_args: unknown setting(s) {unknown}; known: {sorted([*ADAPTER_KINDS, *FIELD_KINDS])}")
    own = {k: _convert(k, v, ADAPTER_KINDS[k]) for k, v in args.items() if k in ADAPTER_KINDS}
    # A text setting given as something else (cache=0) stays as is: DecodeConfig's check names it.
    decode = {k: v if FIELD_KINDS[k].endswith("str") and not isinstance(v, str) else _convert(k, v, FIELD_KINDS[k])
              for k, v in args.items() if k in FIELD_KINDS}
    return own, decode


@dataclasses.dataclass(frozen=True)
class Settings:
    """Checked model args: the adapter's own settings and the decoding config they give."""

    pretrained: Path
    dtype: str | None
    config: DecodeConfig  # the model's generation defaults with the model args' fields
    gen_length_given: bool  # an explicit gen_length wins over the tasks' max_gen_toks
    engine: bool
    batch_size: int
    mc_num: int
    chat: bool
    seed: int
    affix_mode: str | None
    shots: int
    fewshot_seed: int | None
    include_path: str | None
    pool_tokens: int | None  # engine: KV pool size in tokens (default: the engine's)
    compile_cache: str | None = None  # a directory or "off" (None: the environment's, else the default)

    @property
    def group(self) -> int:
        """Loglikelihood samples per stratified group (LLaDA's batch)."""
        return min(self.batch_size, self.mc_num)


def settings(model_args: dict[str, Any]) -> Settings:
    """Every model arg checked, with the decoding config it gives; reads the model's config.json and
    generation_config.json but no weights, so a bad setting is reported before any work."""
    own, overrides = parse_model_args(model_args)
    get = own.get
    dtype = None if get("dtype") == "auto" else get("dtype")  # "auto", as HF models take it: as stored
    batch = DEFAULT_BATCH if get("batch_size") is None else get("batch_size")  # 0 is refused below, not defaulted
    s = Settings(Path(get("pretrained") or DEFAULT_MODEL), dtype, DecodeConfig(), "gen_length" in overrides,
                 get("engine", False), batch, get("mc_num", 128), get("chat", True),
                 get("seed", 0), get("affix_mode"), get("num_fewshot_affix", 0), get("fewshot_seed"),
                 get("include_path"), get("pool_tokens"), get("compile_cache"))
    for name, value, low in (("batch_size", s.batch_size, 1), ("mc_num", s.mc_num, 1),
                             ("num_fewshot_affix", s.shots, 0), ("seed", s.seed, 0),
                             ("fewshot_seed", s.fewshot_seed or 0, 0), ("pool_tokens", s.pool_tokens or 1, 1)):
        if not low <= value <= MAX_SEED:
            raise InputError(f"model_args: {name} must be an integer in [{low}, {MAX_SEED}], got {value}")
    if s.mc_num % s.group:
        raise InputError(f"model_args: mc_num ({s.mc_num}) must be a multiple of batch_size ({s.batch_size}): "
                         "loglikelihood samples come in stratified groups of batch_size")
    if s.compile_cache is not None:
        try:
            compile_cache.check_setting(s.compile_cache)
        except ValueError as e:
            raise InputError(f"model_args: compile_cache: {e}") from None
    if s.dtype is not None and s.dtype not in DTYPES:
        raise InputError(f"model_args: dtype must be one of {sorted(DTYPES)}, got {s.dtype!r}")
    if s.affix_mode is not None and s.affix_mode not in AFFIX_POSITIONS:
        raise InputError(f"model_args: affix_mode must be one of {AFFIX_POSITIONS}, got {s.affix_mode!r}")
    if (s.affix_mode is None) != (s.shots == 0):
        raise InputError("model_args: affix mode needs both affix_mode=prefix|infix|suffix and num_fewshot_affix=N "
                         "(N >= 1 few-shot examples become the shared affix)")
    if s.affix_mode and not s.chat:
        raise InputError("model_args: affix mode serializes every prompt with the model's chat template (the "
                         "paper's appendix A); chat=false does not go with it")
    if s.affix_mode and not s.include_path:
        raise InputError("model_args: affix mode reads each task's few-shot documents: give include_path=DIR "
                         "(python -m acache_jax.lm_eval passes its --include_path on)")
    if not s.pretrained.is_dir():
        raise InputError(f"model_args: pretrained={s.pretrained} is not a model directory")
    mcfg = ModelConfig.from_file(s.pretrained)
    defaults, _ = read_generation_config(s.pretrained, mcfg)
    try:
        config = defaults.replace(**overrides)
        if s.engine:
            check_engine_config(config)
        if config.selective and config.cfg_scale > 0:
            raise DecodeError("classifier-free guidance is not supported with selective recompute")
        if s.gen_length_given:  # a prompt needs at least one token of the context
            check_context(mcfg.max_seq_len, prompt=1, gen_length=config.gen_length)
    except InputError as e:
        source = s.pretrained / GENERATION_CONFIG_FILE
        message = name_defaults(str(e), defaults, source if source.is_file() else None, overrides)
        raise InputError(f"model_args: {message}") from None
    if config.selective and not s.affix_mode:
        raise InputError(f"model_args: cache={config.cache} reuses a shared affix's cache: set "
                         "affix_mode=prefix|infix|suffix and num_fewshot_affix=N (the few-shot examples are the affix)")
    return dataclasses.replace(s, config=config)


@dataclasses.dataclass
class _Job:
    request: Request
    config: DecodeConfig
    affix: str | None  # the task whose affix the request shares (affix mode)
    until: list[str]
    max_tokens: int | None


class ACacheLM(LM):
    """lm-eval's view of an acache-jax model (the module docstring lists the model args)."""

    def __init__(self, **model_args: Any):
        super().__init__()
        self.settings = s = settings(model_args)
        self.config = s.config
        compile_cache.enable(s.compile_cache)
        self.model = load(s.pretrained, dtype=s.dtype)
        if self.model.tokenizer is None:
            raise InputError(f"{s.pretrained} ships no tokenizer; lm-eval hands over text")
        if s.affix_mode:
            chat_layout.check(self.model, s.affix_mode)
        self._affixes: dict[str, chat_layout.ChatAffix] = {}
        self._caches: dict[str, AffixCache] = {}  # selective policies: each task's affix computed once
        self._engines: dict[DecodeConfig, Engine] = {}
        self._pool: PagedPool | None = None  # the engines'
        self._configs: dict[int, DecodeConfig] = {}

    # -- prompts ------------------------------------------------------------------------------

    def _context(self, text: str) -> tuple[str, bool]:
        """(the text the model reads, whether the tokenizer adds its special tokens to it)."""
        if self.settings.chat and getattr(self.model.tokenizer, "chat_template", None):
            rendered = self.model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                add_generation_prompt=True, tokenize=False)
            return rendered, False
        return text, True

    @staticmethod
    def _fields(doc: Any, fields: tuple[str, ...], what: str) -> list[str]:
        missing = [f for f in fields if not isinstance(doc, dict) or not isinstance(doc.get(f), str)]
        if missing:
            raise InputError(f"affix mode: {what} lacks the text field(s) {missing} (the paper's layouts are built "
                             "from document fields; see eval/lm_eval_tasks)")
        return [doc[f] for f in fields]

    def affix(self, task: str) -> chat_layout.ChatAffix:
        """The task's shared affix: N of its few-shot documents, serialized once (and, for the selective
        policies, computed once into the affix cache every request of the task reuses)."""
        if task in self._affixes:
            return self._affixes[task]
        from lm_eval.tasks import TaskManager  # noqa: PLC0415 (only affix mode reads task configs)

        s = self.settings
        manager = TaskManager(include_path=s.include_path, include_defaults=False)
        if task not in manager.all_tasks:
            raise InputError(f"affix mode: task {task!r} is not under include_path {s.include_path}")
        pool = list(manager.load([task])["tasks"][task].fewshot_docs())
        if len(pool) < s.shots:
            raise InputError(f"affix mode: task {task!r} has {len(pool)} few-shot documents, fewer than "
                             f"num_fewshot_affix={s.shots}")
        picked = (range(s.shots) if s.fewshot_seed is None
                  else np.random.default_rng(s.fewshot_seed).choice(len(pool), s.shots, replace=False))
        shots = [self._fields(pool[int(i)], SHOT_FIELDS, f"few-shot document {int(i)} of {task!r}") for i in picked]
        shared = chat_layout.affix(self.model, s.affix_mode, shots)
        self._affixes[task] = shared
        if self.config.selective:
            self._caches[task] = build_affix_cache(self.model, shared.ids)
        k = self.config.anchors(len(shared.ids)) if self.config.selective else len(shared.ids)
        log.info("affix of %s: %d %s example(s), %d tokens, %d computed per request", task, s.shots, s.affix_mode,
                 len(shared.ids), k)
        return shared

    def _affix_request(self, req: Any, seed: int) -> Request:
        """The request in the paper's layout, from its document's fields (never parsed out of the prompt)."""
        where = f"document {req.doc_id} of {req.task_name!r}"
        infix = self.settings.affix_mode == "infix"
        query, *infix_fields = self._fields(req.doc, REQUEST_FIELDS[infix], where)
        if req.args[0] != query:
            raise InputError(f"affix mode: lm-eval's prompt for {where} is not its query field as is; run with "
                             "--num_fewshot 0, without --apply_chat_template / --system_instruction, and with "
                             "doc_to_text: query")
        return chat_layout.request(self.model, self.affix(req.task_name), query, *infix_fields, seed=seed)

    # -- lm-eval's calls ----------------------------------------------------------------------

    def _config_for(self, max_tokens: int | None, where: str) -> DecodeConfig:
        """The decoding config of a request: max_gen_toks rounded up to whole blocks, unless gen_length was given."""
        if max_tokens is None or self.settings.gen_length_given:
            return self.config
        length = math.ceil(max_tokens / self.config.block_length) * self.config.block_length
        if length not in self._configs:
            try:
                self._configs[length] = self.config.replace(gen_length=length)
            except DecodeError as e:
                raise InputError(f"{where}: max_gen_toks {max_tokens} gives gen_length {length}: {e}") from None
        return self._configs[length]

    def request(self, instance: Any) -> Request:
        """The `Request` a generate_until instance decodes as (its layout, ids and seed)."""
        return self._job(instance).request

    def _job(self, req: Any) -> _Job:
        context, gen_kwargs = req.args
        where = f"document {req.doc_id} of {req.task_name!r}"
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [u for u in until if u]
        max_tokens = gen_kwargs.get("max_gen_toks")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens <= 0):
            raise InputError(f"{where}: max_gen_toks must be a positive integer, got {max_tokens!r}")
        seed = (self.settings.seed + (req.doc_id or 0)) % (MAX_SEED + 1)
        if self.settings.affix_mode:
            request, affix = self._affix_request(req, seed), req.task_name
        else:
            text, special = self._context(context)
            request, affix = Request(self.model.encode(text, chat=False, special_tokens=special), seed=seed), None
        config = self._config_for(max_tokens, where)
        affix_ids = None if affix is None else self.affix(affix).ids
        try:  # lengths by arithmetic, before any request of the call is decoded
            check_request(request, config.gen_length, self.model.config, affix_ids)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        return _Job(request, config, affix, until, max_tokens)

    def _decode(self, config: DecodeConfig, requests: list[Request], affix: Any, progress: bool) -> list[np.ndarray]:
        if not self.settings.engine:
            return generate(self.model, requests, config, affix=affix, max_batch=self.settings.batch_size,
                            progress=progress).tokens
        key = config.engine_key()  # tasks' gen lengths share an engine; other settings each have one, in one KV pool
        if key not in self._engines:
            if self._pool is None:
                self._pool = pool_for(self.model, [config], self.settings.batch_size,
                                      pool_tokens=self.settings.pool_tokens)
            self._engines[key] = Engine(self.model, config, max_batch=self.settings.batch_size, pool=self._pool)
        return [r.tokens for r in self._engines[key].generate(requests, affix, config=config)]

    def _text(self, job: _Job, tokens: np.ndarray) -> str:
        ids = self.model.answer_ids(tokens)[:job.max_tokens]
        text = self.model.tokenizer.decode(ids, skip_special_tokens=True)
        for stop in job.until:
            text = text.split(stop)[0]
        return text

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        jobs = [self._job(r) for r in requests]  # every request laid out and checked before decoding
        groups: dict[tuple[DecodeConfig, str | None], list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            groups[(job.config, job.affix)].append(i)
        texts: list[str] = [""] * len(jobs)
        for (config, task), members in groups.items():
            affix = None if task is None else self._caches.get(task) or self._affixes[task].ids
            tokens = self._decode(config, [jobs[i].request for i in members], affix, progress=not disable_tqdm)
            for i, t in zip(members, tokens):
                texts[i] = self._text(jobs[i], t)
                self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
            log.info("generated %d answers (gen_length %d, cache %s)", len(members), config.gen_length, config.cache)
        return texts

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """LLaDA's split: trailing spaces move to the continuation; the continuation is the tokens of
        context + continuation past those of the context alone."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        text, special = self._context(context)
        whole = self.model.encode(text + continuation, chat=False, special_tokens=special)
        prompt = self.model.encode(text, chat=False, special_tokens=special)
        return prompt, whole[len(prompt):]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.settings.affix_mode:
            raise InputError("affix mode places few-shot examples into generation prompts; loglikelihood "
                             f"(multiple-choice) tasks such as {requests[0].task_name!r} run without it")
        pairs = [self._pair(*r.args) for r in requests]
        for r, (_, continuation) in zip(requests, pairs):
            if not continuation:
                raise InputError(f"document {r.doc_id} of {r.task_name!r}: continuation {r.args[1]!r} has no tokens "
                                 "of its own")
        s = self.settings
        scores = likelihood.loglikelihood(self.model, pairs, mc_num=s.mc_num, group=s.group, rows=s.batch_size,
                                          seed=s.seed, cfg_scale=self.config.cfg_scale,
                                          attn_backend=self.config.attn_backend)
        out = [(float(s), False) for s in scores]
        for r, o in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", r.args, o)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise InputError("loglikelihood_rolling (perplexity tasks) is not defined for masked diffusion models: they "
                         "give no left-to-right token probabilities to roll over; LLaDA's evaluation has none either")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise InputError("acache_jax applies the model's chat template itself (model arg chat=true, the default); "
                         "run lm-eval without --apply_chat_template")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template:
            self.apply_chat_template([])
        return None

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> ACacheLM:
        """lm-eval's constructor call; its own settings (batch_size, device, ...) fill what model_args leave unset."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> ACacheLM:
        from lm_eval.utils import simple_parse_args_string  # noqa: PLC0415

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)


def parser():
    """lm-eval's `run` parser: every flag `python -m acache_jax.lm_eval` takes (for checking a command)."""
    from lm_eval._cli.harness import HarnessCLI  # noqa: PLC0415

    return HarnessCLI()._subparsers.choices["run"]


def _only_included_tasks(known: Any) -> bool:
    """Whether every name of --tasks is a task, group or tag under --include_path (then lm-eval's
    own catalogue of some 15,000 tasks, 9 s to index on a CPU, is not needed)."""
    if not known.include_path or not known.tasks:
        return False
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    entries = [known.tasks] if isinstance(known.tasks, str) else known.tasks
    names = [name for entry in entries for name in entry.split(",") if name]
    own = TaskManager(include_path=known.include_path, include_defaults=False).all_tasks
    return bool(names) and all(name in own for name in names)


@contextlib.contextmanager
def _without_lm_eval_catalogue():
    """lm-eval's task managers made during the block index --include_path alone (its CLI builds its
    own manager and has no flag for that)."""
    import lm_eval.tasks  # noqa: PLC0415

    full = lm_eval.tasks.TaskManager

    class IncludedOnly(full):
        def __init__(self, *args: Any, include_defaults: bool = False, **kwargs: Any):
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval.tasks.TaskManager = IncludedOnly
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = full


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with `acache_jax` registered. With --model acache_jax, every model arg
    is checked first (lm-eval indexes its thousands of tasks before it builds the model), and
    --include_path also reaches the adapter's affix mode. When --include_path holds every task
    asked for, lm-eval's own tasks are not indexed."""
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    argv = list(sys.argv[1:] if argv is None else argv)
    helping = bool({"-h", "--help"} & set(argv))
    known = None if helping else parser().parse_known_args(argv[1:] if argv[:1] == ["run"] else argv)[0]
    try:
        if known is not None and known.model == MODEL_NAME:
            model_args = dict(known.model_args or {})
            if known.include_path and "include_path" not in model_args:
                argv += ["--model_args", json.dumps({"include_path": known.include_path})]
                model_args["include_path"] = known.include_path
            # lm-eval hands the model its --batch_size (default 1) unless model_args hold one
            settings({"batch_size": getattr(known, "batch_size", 1)} | model_args)
        sys.argv = ["python -m acache_jax.lm_eval", *argv]
        included_only = known is not None and _only_included_tasks(known)
        with _without_lm_eval_catalogue() if included_only else contextlib.nullcontext():
            cli_evaluate()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


import lm_eval.models  # noqa: E402, F401 (lm-eval loads its own models only into an empty registry)

register_model(MODEL_NAME)(ACacheLM)

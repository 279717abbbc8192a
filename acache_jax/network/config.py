"""What a model directory's two JSON files say: the network (`config.json` -> `ModelConfig`) and
how to decode with it (`generation_config.json` -> the model's default `DecodeConfig`).

Every size and token id comes from config.json; a missing field or an architecture option we do not
implement is reported by name instead of being silently defaulted. Generation defaults belong to
the model, as in the HF ecosystem: every entry point starts from them and flags or request fields
override them; a directory without the file falls back to `DecodeConfig()`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal


Family = Literal["llada", "dream"]
CachePolicy = Literal["none", "prefix", "dual", "acache", "direct"]
Remasking = Literal["low_confidence", "random"]  # LLaDA's confidence
DreamAlg = Literal["origin", "maskgit_plus", "topk_margin", "entropy"]  # Dream's confidence
CACHE_POLICIES = ("none", "prefix", "dual", "acache", "direct")
SELECTORS = ("attention", "hkvd", "hkvd_block", "random", "bottom")
ATTENTION_BACKENDS = ("xla", "cudnn", "pallas")
GENERATION_CONFIG_FILE = "generation_config.json"

# model_type in config.json -> our family name.
_FAMILIES: dict[str, Family] = {"llada": "llada", "Dream": "dream"}
# Other diffusion LMs, by config.json's architectures entry or model_type: refused by name, before any
# field or tensor is read (LLaDA-MoE even shares model_type "llada").
LOOK_ALIKES = {name: what for what, names in [
    ("LLaDA-MoE (a mixture-of-experts model)", ("LLaDAMoEModelLM", "lladamoe")),
    ("LLaDA2.x (a mixture-of-experts block-diffusion model)", ("LLaDA2MoeModelLM", "llada2_moe")),
    ("LLaDA-V (LLaDA with a vision tower)", ("LlavaLLaDAModelLM", "llava_llada")),
    ("SDAR / TraDo (block diffusion with causal attention across blocks)", ("SDARForCausalLM", "sdar")),
    ("Fast-dLLM v2 (block-causal attention with a token shift)", ("Fast_dLLM_QwenForCausalLM", "Fast_dLLM_Qwen")),
    ("DiffusionGemma (a mixture-of-experts model denoising without a mask token)",
     ("DiffusionGemmaForBlockDiffusion", "diffusion_gemma")),
    ("Nemotron-Labs Diffusion", ("NemotronLabsDiffusionModel", "nemotron_labs_diffusion")),
] for name in names}
SUPPORTED = "this library runs the LLaDA (LLaDAModelLM) and Dream (DreamModel) architectures"

# Upstream options that would change the computation; each must hold the value we implement
# (the exporter writes them, the reader checks them).
LLADA_FIXED = {
    "weight_tying": False,
    "scale_logits": False,
    "alibi": False,
    "rope": True,
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "include_bias": False,  # biases on every linear layer; q/k/v-only biases are `include_qkv_bias`
}
DREAM_FIXED = {"tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False}


class InputError(ValueError):
    """Input this library cannot use, named in the message: the root of every error we raise for a
    bad setting, request, file or call (entry points report it as one line)."""


class ConfigError(InputError):
    """config.json or generation_config.json does not describe a model this library can run."""


class DecodeError(InputError):
    """A generation setting that cannot be run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a bidirectional LLaDA/Dream transformer (hashable: usable as a jit static)."""

    family: Family
    vocab_size: int  # rows of the embedding and the LM head (LLaDA: `embedding_size`)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_seq_len: int
    qkv_bias: bool
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None = None

    @property
    def logit_shift(self) -> bool:
        """Dream predicts token i from position i-1 (it was initialised from an AR model)."""
        return self.family == "dream"

    @property
    def num_params(self) -> int:
        d, h, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * h + 2 * d * kv + h * d + (h + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * d * self.intermediate_size + 2 * d
        return self.num_layers * layer + 2 * self.vocab_size * d + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from the parsed `config.json` dictionary of an HF LLaDA or Dream checkpoint."""
        if not isinstance(hf, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") if isinstance(hf.get("architectures"), list) else []
        for name in [*map(str, architectures), str(model_type)]:
            if name in LOOK_ALIKES:
                raise ConfigError(f"config.json describes {LOOK_ALIKES[name]} ({name}), which is not supported: "
                                  f"{SUPPORTED}")
        quantized = next((k for k in ("quantization_config", "quantization") if hf.get(k)), None)
        if quantized:
            method = hf[quantized].get("quant_method", "MLX") if isinstance(hf[quantized], dict) else "?"
            raise ConfigError(f"config.json describes quantized weights ({quantized}: {method}), which are not "
                              "supported: load the bf16 checkpoint it was made from")
        if model_type not in _FAMILIES:
            raise ConfigError(
                f"unknown model_type {model_type!r} in config.json; supported: {sorted(_FAMILIES)}"
            )
        family = _FAMILIES[model_type]
        read = _Reader(hf, model_type)
        if family == "llada":
            read.check_fixed(LLADA_FIXED)
            hidden, heads = read.int("d_model"), read.int("n_heads")
            kv_heads = hf.get("n_kv_heads") or heads
            cfg = cls(
                family=family,
                vocab_size=hf.get("embedding_size") or read.int("vocab_size"),
                hidden_size=hidden,
                num_layers=read.int("n_layers"),
                num_heads=heads,
                num_kv_heads=int(kv_heads),
                head_dim=hidden // heads,
                intermediate_size=read.int("mlp_hidden_size"),
                rope_theta=read.float("rope_theta"),
                rms_norm_eps=read.float("rms_norm_eps"),
                max_seq_len=read.int("max_sequence_length"),
                qkv_bias=bool(hf.get("include_qkv_bias")),
                mask_token_id=read.int("mask_token_id"),
                eos_token_id=read.token("eos_token_id"),
                pad_token_id=read.token("pad_token_id"),
                bos_token_id=hf.get("bos_token_id"),
            )
        else:
            read.check_fixed(DREAM_FIXED)
            hidden, heads = read.int("hidden_size"), read.int("num_attention_heads")
            cfg = cls(
                family=family,
                vocab_size=read.int("vocab_size"),
                hidden_size=hidden,
                num_layers=read.int("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=read.int("num_key_value_heads"),
                head_dim=hf.get("head_dim") or hidden // heads,
                intermediate_size=read.int("intermediate_size"),
                rope_theta=read.float("rope_theta"),
                rms_norm_eps=read.float("rms_norm_eps"),
                max_seq_len=read.int("max_position_embeddings"),
                qkv_bias=True,
                mask_token_id=read.int("mask_token_id"),
                eos_token_id=read.token("eos_token_id"),
                pad_token_id=read.token("pad_token_id"),
                bos_token_id=hf.get("bos_token_id"),
            )
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        return cls.from_hf(read_json(path))

    def validate(self) -> None:
        problems = []
        if self.num_heads * self.head_dim != self.hidden_size:
            problems.append(f"num_heads*head_dim = {self.num_heads * self.head_dim} != hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even for RoPE")
        for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                problems.append(f"{name} {getattr(self, name)} outside the vocabulary [0, {self.vocab_size})")
        if problems:
            raise ConfigError("inconsistent model config: " + "; ".join(problems))


class _Reader:
    """Field access with errors that name the missing or malformed field."""

    def __init__(self, hf: dict[str, Any], model_type: str):
        self.hf, self.model_type = hf, model_type

    def _get(self, key: str) -> Any:
        if self.hf.get(key) is None:
            raise ConfigError(f"config.json (model_type {self.model_type!r}) lacks required field {key!r}")
        return self.hf[key]

    def int(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"config.json field {key!r} must be a positive integer, got {value!r}")
        return value

    def float(self, key: str) -> float:
        value = self._get(key)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"config.json field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def token(self, key: str) -> int:
        value = self._get(key)
        if isinstance(value, list) and value:  # some configs list several eos ids; the first is the canonical one
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"config.json field {key!r} must be a token id, got {value!r}")
        return value

    def check_fixed(self, expected: dict[str, Any]) -> None:
        for key, want in expected.items():
            if key in self.hf and self.hf[key] is not None and self.hf[key] != want:
                raise ConfigError(
                    f"config.json sets {key}={self.hf[key]!r}; only {key}={want!r} is supported"
                )


def read_json(path: str | Path) -> Any:
    """A JSON file's content; a file that cannot be read or parsed is named in the error."""
    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None


def anchor_count(ratio: float, affix_len: int) -> int:
    """K = min(ceil(ratio * L), L)."""
    if not 0.0 <= ratio <= 1.0:
        raise DecodeError(f"anchor ratio must be in [0, 1], got {ratio}")
    return min(math.ceil(ratio * affix_len), affix_len)


def _kind_error(name: str, value: Any, kind: str) -> str | None:
    """Why `value` is not of `kind` (None when it is). Strings are never numbers or booleans."""
    optional = kind.startswith("opt ")
    if optional:
        if value is None:
            return None
        kind = kind[4:]
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
    what = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}[kind]
    return None if ok else f"{name} must be {what}{' or null' * optional}, got {value!r}"


# DecodeConfig's sampler numbers: traced in compiled programs (`sampling.SamplerValues`), so that
# their static key (`DecodeConfig.program_key`) keeps only which rule each one selects.
SAMPLER_VALUES = ("temperature", "threshold", "factor", "alg_temp", "top_p")


def _sampler_rule(name: str, value: float | None) -> float | None:
    """A stand-in for a sampler number that selects the same rule (sampling.py tests only these):
    on or off for the temperatures (> 0), set or not for threshold and factor, and whether top_p
    (below 1) cuts."""
    if value is None:
        return None
    if name == "top_p":
        return 0.5 if value < 1 else 1.0
    if name in ("temperature", "alg_temp"):
        return 1.0 if value > 0 else 0.0
    return 1.0


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Decoding settings (hashable: one compiled program per distinct config and bucket).

    The class defaults are what a model without a generation_config.json decodes with; a loaded
    model's defaults are `Model.generation_config`, and `Model.decode_config(**overrides)` starts
    from them.
    """

    gen_length: int = 256
    block_length: int = 32
    steps: int | None = None  # fixed-schedule steps over the whole generation (default gen_length)
    threshold: float | None = 0.9  # Fast-dLLM parallel decoding; None = fixed schedule from `steps`
    factor: float | None = None  # Fast-dLLM factor rule (overrides threshold)
    temperature: float = 0.0
    remasking: Remasking = "low_confidence"  # LLaDA
    alg: DreamAlg = "maskgit_plus"  # Dream
    alg_temp: float = 0.0  # Dream
    top_p: float | None = None  # Dream
    top_k: int | None = None  # Dream
    cfg_scale: float = 0.0  # classifier-free guidance (LLaDA)
    cache: CachePolicy = "dual"
    anchor_ratio: float = 0.2  # acache: K = min(ceil(ratio * L), L) anchors per request
    # Adaptive budget (None: every request gets K): a request's anchors are the fewest of its
    # best-ranked affix tokens that hold this share of its selector's score mass, at least
    # anchor_min_ratio and at most anchor_ratio of its affix.
    anchor_mass: float | None = None
    anchor_min_ratio: float = 0.0
    selector: str = "attention"  # acache: attention | hkvd | hkvd_block | random | bottom
    drop_non_anchor: bool = False  # acache DropNA ablation: non-anchor affix K/V are discarded
    # A request whose finished block is all end-of-text (eos) commits the rest of its generation as
    # end-of-text without computing it. Off for upstream parity (upstream computes every block).
    early_stop: bool = True
    attn_backend: str | None = None  # None: pallas on a GPU, else xla

    @property
    def selective(self) -> bool:
        """Block starts recompute only private positions against a shared affix cache."""
        return self.cache in ("acache", "direct")

    def anchors(self, affix_len: int) -> int:
        """The most anchors a request with this affix gets (all of them under a fixed budget)."""
        return 0 if self.cache == "direct" else anchor_count(self.anchor_ratio, affix_len)

    def min_anchors(self, affix_len: int) -> int:
        """The fewest anchors a request with this affix gets."""
        if self.anchor_mass is None:
            return self.anchors(affix_len)
        return min(anchor_count(self.anchor_min_ratio, affix_len), self.anchors(affix_len))

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return (self.steps or self.gen_length) // self.num_blocks

    def with_gen_length(self, gen_length: int) -> DecodeConfig:
        """This config at another generation length (a multiple of the block length): the same
        schedule per block, as the engine and the server run each request at its own length."""
        if gen_length == self.gen_length:
            return self
        steps = None if self.steps is None else self.steps_per_block * (gen_length // self.block_length)
        return self.replace(gen_length=gen_length, steps=steps)

    def program_key(self) -> DecodeConfig:
        """This config as compiled programs' static argument: the anchor ratios only bound how many
        anchors a request gets (on the host), and the sampler's numbers travel traced beside the key
        (`sampling.SamplerValues`), which keeps only which of their rules apply; so configs that
        differ only there share programs (a server's request with its own temperature compiles
        nothing new)."""
        return dataclasses.replace(self, anchor_ratio=DecodeConfig.anchor_ratio,
                                   anchor_min_ratio=DecodeConfig.anchor_min_ratio,
                                   **{name: _sampler_rule(name, getattr(self, name)) for name in SAMPLER_VALUES})

    def engine_key(self) -> DecodeConfig:
        """The program key at one block (gen length and steps those of one block): the engine's
        jitted steps see one block at a time, so configs that differ only in their gen length (with
        the same steps per block) and in what `program_key` drops run on one engine and its
        compiled programs, each request at its own length."""
        return dataclasses.replace(self.program_key(), gen_length=self.block_length, steps=self.steps_per_block)

    def replace(self, **overrides: Any) -> DecodeConfig:
        """A copy with these fields changed (validated); an unknown field name is an error."""
        unknown = sorted(set(overrides) - set(FIELD_KINDS))
        if unknown:
            raise DecodeError(f"unknown decoding setting(s) {unknown}; known: {sorted(FIELD_KINDS)}")
        config = dataclasses.replace(self, **overrides)
        config.validate()
        return config

    def validate(self) -> None:
        def fail(msg):
            raise DecodeError(msg)

        for name, kind in FIELD_KINDS.items():
            problem = _kind_error(name, getattr(self, name), kind)
            if problem:
                fail(problem)
        if self.gen_length <= 0 or self.block_length <= 0:
            fail(f"gen_length ({self.gen_length}) and block_length ({self.block_length}) must be positive")
        if self.gen_length % self.block_length:
            fail(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length})")
        if self.steps is not None and (self.steps <= 0 or self.steps % self.num_blocks):
            fail(f"steps ({self.steps}) must be a positive multiple of the number of blocks ({self.num_blocks})")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            fail(f"threshold must be in (0, 1], got {self.threshold}")
        if self.factor is not None and self.factor <= 0:
            fail(f"factor must be positive, got {self.factor}")
        if self.temperature < 0 or self.alg_temp < 0 or self.cfg_scale < 0:
            fail("temperature, alg_temp and cfg_scale must be >= 0")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k <= 0:
            fail(f"top_k must be positive, got {self.top_k}")
        if self.cache not in CACHE_POLICIES:
            fail(f"unknown cache policy {self.cache!r}; choose one of {CACHE_POLICIES}")
        if self.attn_backend is not None and self.attn_backend not in ATTENTION_BACKENDS:
            fail(f"unknown attention backend {self.attn_backend!r}; choose one of {ATTENTION_BACKENDS}")
        if self.attn_backend == "cudnn":
            import jax  # noqa: PLC0415 (only this check needs the runtime)

            if jax.default_backend() != "gpu":
                fail(f"attention backend 'cudnn' needs a GPU; this process runs on {jax.default_backend()} "
                     "(use xla or pallas)")
        if self.remasking not in ("low_confidence", "random"):
            fail(f"unknown remasking {self.remasking!r}; choose low_confidence or random")
        if self.alg not in ("origin", "maskgit_plus", "topk_margin", "entropy"):
            fail(f"unknown Dream alg {self.alg!r}; choose origin, maskgit_plus, topk_margin or entropy")
        if not 0.0 <= self.anchor_ratio <= 1.0:
            fail(f"anchor ratio must be in [0, 1], got {self.anchor_ratio}")
        if self.anchor_mass is not None:
            if not 0.0 < self.anchor_mass <= 1.0:
                fail(f"anchor mass must be in (0, 1], got {self.anchor_mass}")
            if not 0.0 <= self.anchor_min_ratio <= self.anchor_ratio:
                fail(f"anchor min ratio must be in [0, anchor_ratio={self.anchor_ratio}], got {self.anchor_min_ratio}")
            if self.selector == "bottom":
                fail("an anchor mass needs a selector whose scores are importances, not 'bottom'")
        if self.selector not in SELECTORS:
            fail(f"unknown anchor selector {self.selector!r}; choose one of {SELECTORS}")


def _kind(annotation: Any) -> str:
    """A field's annotation as a kind: "int", "float", "bool" or "str" (a Literal's values are
    strings), prefixed "opt " where None is allowed."""
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType)  # only `X | None` here
    base = next(a for a in typing.get_args(annotation) if a is not type(None)) if optional else annotation
    kind = "str" if typing.get_origin(base) is typing.Literal else base.__name__
    return f"opt {kind}" if optional else kind


# The type each DecodeConfig field must have ("opt" = may also be None), from its annotation; checked
# before any value, and what readers of settings given as text (the lm-eval adapter's model_args)
# convert by.
FIELD_KINDS = {name: _kind(hint) for name, hint in typing.get_type_hints(DecodeConfig).items()}


def resolve_decode_config(config: DecodeConfig | None, default: DecodeConfig) -> DecodeConfig:
    """The config to run (`default`, the model's own, when None), validated; anything that is not a
    DecodeConfig is a clear error."""
    if config is None:
        return default
    if not isinstance(config, DecodeConfig):
        raise DecodeError(f"config must be a DecodeConfig (e.g. model.decode_config(cache='acache')), "
                          f"got {type(config).__name__}")
    config.validate()
    return config


# generation_config.json key -> DecodeConfig field (HF's own name where it has one).
GENERATION_KEYS = {
    "max_new_tokens": "gen_length", "block_length": "block_length", "steps": "steps", "threshold": "threshold",
    "factor": "factor", "temperature": "temperature", "remasking": "remasking", "alg": "alg", "alg_temp": "alg_temp",
    "top_p": "top_p", "top_k": "top_k", "cfg_scale": "cfg_scale", "early_stop": "early_stop",
}


def read_generation_config(directory: str | Path, mcfg: ModelConfig) -> tuple[DecodeConfig, tuple[int, ...]]:
    """(the model's default DecodeConfig, its end-of-text ids) from directory/generation_config.json.

    Without the file: (DecodeConfig(), (eos,)). Keys other than GENERATION_KEYS and the special ids
    are ignored (HF files carry many); a null value counts as unset, as in HF, except for
    `threshold`, where null selects the fixed schedule (as `DecodeConfig.threshold = None`). `eos_token_id` may
    list several ids (generation ends at any of them); mask and pad ids must agree with config.json.
    """
    path = Path(directory) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return DecodeConfig(), (mcfg.eos_token_id,)
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    for key in ("mask_token_id", "pad_token_id"):
        if raw.get(key) is not None and raw[key] != getattr(mcfg, key):
            raise ConfigError(f"{path}: {key} {raw[key]!r} differs from config.json's {getattr(mcfg, key)}")
    eos = raw.get("eos_token_id")
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < mcfg.vocab_size for t in eos):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {raw['eos_token_id']!r}")
    try:
        config = DecodeConfig().replace(**{field: raw[key] for key, field in GENERATION_KEYS.items()
                                           if raw.get(key) is not None or (key == "threshold" and key in raw)})
    except DecodeError as e:
        message = str(e)
        for key, field in GENERATION_KEYS.items():  # the file's own names (max_new_tokens, not gen_length)
            message = re.sub(rf"\b{field}\b", key, message)
        raise ConfigError(f"{path}: {message}") from None
    return config, tuple(dict.fromkeys([mcfg.eos_token_id, *eos]))


def name_defaults(message: str, defaults: DecodeConfig, source: Path | None, given: Iterable[str]) -> str:
    """`message` (an error about decoding settings) with a note for each generation setting it names
    that the caller did not give: its value is the model's default, and where that came from (the
    key in generation_config.json), so that a user who never typed gen_length learns why it is 32."""
    notes = []
    for key, field in GENERATION_KEYS.items():
        if field in given or not re.search(rf"\b{field}\b", message):
            continue
        value = getattr(defaults, field)
        from_file = source is not None and value != getattr(DecodeConfig, field)
        notes.append(f"{field} {value!r} is the model's default, from {key} in {source}" if from_file
                     else f"{field} {value!r} is DecodeConfig's default")
    return message if not notes else f"{message} ({'; '.join(notes)})"


def generation_config_json(config: DecodeConfig, mcfg: ModelConfig) -> dict[str, Any]:
    """The generation_config.json that `read_generation_config` reads back as `config`: every
    generation setting that differs from DecodeConfig()'s, the lengths and threshold always."""
    default = DecodeConfig()
    out: dict[str, Any] = {}
    for key, field in GENERATION_KEYS.items():
        value = getattr(config, field)
        if value != getattr(default, field) or field in ("gen_length", "block_length", "threshold"):
            out[key] = value
    return out | {"mask_token_id": mcfg.mask_token_id, "eos_token_id": mcfg.eos_token_id,
                  "pad_token_id": mcfg.pad_token_id}

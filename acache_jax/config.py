"""Model configuration read from a Hugging Face `config.json` of the LLaDA or Dream family.

Every size and token id comes from the file; a missing field or an architecture option we do not
implement is reported by name instead of being silently defaulted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

Family = Literal["llada", "dream"]

# model_type in config.json -> our family name.
_FAMILIES: dict[str, Family] = {"llada": "llada", "Dream": "dream"}

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


class ConfigError(ValueError):
    """config.json does not describe a model this library can run."""


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
        model_type = hf.get("model_type")
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
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf(hf)

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

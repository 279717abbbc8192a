"""Our parameters -> an HF LLaDA / Dream checkpoint directory: the inverse of convert/hf_layout.py.

Writes config.json (every field `ModelConfig.from_hf` reads, with the fixed architecture options of
the family) and model.safetensors, each to a temporary file renamed into place, so `acache_jax.load`
reads back exactly what was exported.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from acache_jax.checkpoint import TOKENIZER_FILES
from acache_jax.config import DREAM_FIXED, LLADA_FIXED, ModelConfig
from convert.hf_layout import NUMPY_DTYPES, key_map


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of `cfg` in its family's HF layout (`ModelConfig.from_hf` inverts it)."""
    ids = {"mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.bos_token_id is not None:
        ids["bos_token_id"] = cfg.bos_token_id
    if cfg.family == "llada":
        return {
            "model_type": "llada", "architectures": ["LLaDAModelLM"], **LLADA_FIXED,
            "d_model": cfg.hidden_size, "n_heads": cfg.num_heads, "n_kv_heads": cfg.num_kv_heads,
            "n_layers": cfg.num_layers, "mlp_hidden_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size,
            "max_sequence_length": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
            "include_qkv_bias": cfg.qkv_bias, "rope_full_precision": True, **ids, "torch_dtype": dtype,
            "use_cache": False,
        }
    if not cfg.qkv_bias:
        raise ValueError("the Dream layout always has q/k/v biases; this config has none")
    return {
        "model_type": "Dream", "architectures": ["DreamModel"], **DREAM_FIXED,
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "sliding_window": None, **ids, "torch_dtype": dtype,
    }


def _write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # safetensors creates files readable by their owner only
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def export_hf(dst: str | Path, cfg: ModelConfig, params: nnx.State, tokenizer_dir: str | Path | None = None,
              dtype: str = "bfloat16") -> Path:
    """Write `params` (our layout) as an HF checkpoint of cfg's family into dst (created if needed).

    dtype: "bfloat16" or "float32" for the tensors. Tokenizer files found in tokenizer_dir are copied.
    """
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NUMPY_DTYPES)}, got {dtype!r}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tree = jax.device_get(nnx.to_pure_dict(params))
    tensors = {}
    for name, entry in key_map(cfg).items():
        array = tree
        for part in entry.path:
            array = array[part]
        array = np.asarray(array).astype(NUMPY_DTYPES[dtype])
        tensors[name] = np.ascontiguousarray(array.T if entry.transpose else array)
        if tensors[name].shape != entry.hf_shape:
            raise ValueError(f"{name}: parameter of shape {tensors[name].shape}, the config needs {entry.hf_shape}")
    _write(dst / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _write(dst / "config.json", lambda p: p.write_text(json.dumps(hf_config(cfg, dtype), indent=2)))
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != dst.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, dst / name)
    return dst

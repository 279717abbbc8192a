"""Tiny random checkpoints in the exact HF layout of LLaDA and Dream (numpy only: no torch, no jax).

The tensor names here are written out from the upstream checkpoints, independently of the
converter's key map, so the tests check that map rather than restate it. Used by the tests and by
tests/fixtures/generate_model_fixtures.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def llada_config(**overrides) -> dict:
    cfg = {
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "activation_type": "silu",
        "alibi": False, "block_type": "llama", "layer_norm_type": "rms", "rope": True,
        "rope_full_precision": True, "weight_tying": False, "scale_logits": False,
        "include_bias": False, "include_qkv_bias": False,
        "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 96,
        "mlp_ratio": 4, "vocab_size": 128, "embedding_size": 128, "max_sequence_length": 256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "mask_token_id": 127, "eos_token_id": 126, "pad_token_id": 126, "bos_token_id": 125,
        "torch_dtype": "float32", "use_cache": False,
    }
    cfg.update(overrides)
    return cfg


def dream_config(**overrides) -> dict:
    cfg = {
        "model_type": "Dream", "architectures": ["DreamModel"], "hidden_act": "silu",
        "hidden_size": 56, "num_attention_heads": 7, "num_key_value_heads": 1,
        "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 128,
        "max_position_embeddings": 256, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "mask_token_id": 127, "eos_token_id": 126, "pad_token_id": 126, "bos_token_id": 126,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint described by `cfg`, with its PyTorch shape."""
    if cfg["model_type"] == "llada":
        d, heads, kv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
        f, v, n = cfg["mlp_hidden_size"], cfg["embedding_size"], cfg["n_layers"]
        hd = d // heads
        shapes = {"model.transformer.wte.weight": (v, d), "model.transformer.ln_f.weight": (d,),
                  "model.transformer.ff_out.weight": (v, d)}
        for i in range(n):
            b = f"model.transformer.blocks.{i}."
            shapes.update({
                b + "attn_norm.weight": (d,), b + "ff_norm.weight": (d,),
                b + "q_proj.weight": (heads * hd, d), b + "k_proj.weight": (kv * hd, d),
                b + "v_proj.weight": (kv * hd, d), b + "attn_out.weight": (d, heads * hd),
                b + "ff_proj.weight": (f, d), b + "up_proj.weight": (f, d), b + "ff_out.weight": (d, f),
            })
            if cfg.get("include_qkv_bias"):
                shapes.update({b + "q_proj.bias": (heads * hd,), b + "k_proj.bias": (kv * hd,),
                               b + "v_proj.bias": (kv * hd,)})
        return shapes
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    f, v, n = cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = d // heads
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(n):
        b = f"model.layers.{i}."
        shapes.update({
            b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
            b + "self_attn.q_proj.weight": (heads * hd, d), b + "self_attn.q_proj.bias": (heads * hd,),
            b + "self_attn.k_proj.weight": (kv * hd, d), b + "self_attn.k_proj.bias": (kv * hd,),
            b + "self_attn.v_proj.weight": (kv * hd, d), b + "self_attn.v_proj.bias": (kv * hd,),
            b + "self_attn.o_proj.weight": (d, heads * hd),
            b + "mlp.gate_proj.weight": (f, d), b + "mlp.up_proj.weight": (f, d),
            b + "mlp.down_proj.weight": (d, f),
        })
    return shapes


def random_weights(cfg: dict, seed: int = 0, scale: float = 0.15) -> dict[str, np.ndarray]:
    """Random float32 weights; norms near 1, matrices with std `scale` (logits of a useful spread)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(cfg).items():
        if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out


def write_checkpoint(directory: str | Path, cfg: dict, weights: dict[str, np.ndarray], shards: int = 1) -> Path:
    """Write config.json and safetensors (with model.safetensors.index.json when shards > 1)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    if shards == 1:
        save_file(weights, str(directory / "model.safetensors"))
        return directory
    names = list(weights)
    weight_map = {}
    for s, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[i]: weights[names[i]] for i in part}, str(directory / file))
        weight_map.update({names[i]: file for i in part})
    total = sum(w.nbytes for w in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory

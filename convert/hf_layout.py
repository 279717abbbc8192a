"""Reading HF LLaDA / Dream safetensors checkpoints into our parameter layout, one tensor at a time.

Every tensor name, shape and file is checked from the safetensors headers before any data is read,
so a bad checkpoint fails with one error that lists every problem, having loaded nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from acache_jax.config import ModelConfig

ParamPath = tuple  # e.g. ("layers", 3, "attn", "q", "kernel")
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """The HF checkpoint is incomplete, inconsistent or unreadable."""


class Entry(NamedTuple):
    path: ParamPath  # where the tensor goes in our parameter tree
    hf_shape: tuple[int, ...]  # its shape in the HF file (PyTorch Linear: [out, in])
    transpose: bool  # Linear weights become [in, out] kernels


def key_map(cfg: ModelConfig) -> dict[str, Entry]:
    """HF tensor name -> where it goes, for the family and sizes of `cfg`."""
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if cfg.family == "llada":
        top = {
            "model.transformer.wte.weight": Entry(("embed",), (v, d), False),
            "model.transformer.ln_f.weight": Entry(("final_norm", "weight"), (d,), False),
            "model.transformer.ff_out.weight": Entry(("lm_head", "kernel"), (v, d), True),
        }
        prefix = "model.transformer.blocks.{}."
        names = {
            "attn_norm.weight": ("attn_norm", "weight"), "ff_norm.weight": ("mlp_norm", "weight"),
            "q_proj": ("attn", "q"), "k_proj": ("attn", "k"), "v_proj": ("attn", "v"),
            "attn_out": ("attn", "o"), "ff_proj": ("mlp", "gate"), "up_proj": ("mlp", "up"),
            "ff_out": ("mlp", "down"),
        }
    else:
        top = {
            "model.embed_tokens.weight": Entry(("embed",), (v, d), False),
            "model.norm.weight": Entry(("final_norm", "weight"), (d,), False),
            "lm_head.weight": Entry(("lm_head", "kernel"), (v, d), True),
        }
        prefix = "model.layers.{}."
        names = {
            "input_layernorm.weight": ("attn_norm", "weight"),
            "post_attention_layernorm.weight": ("mlp_norm", "weight"),
            "self_attn.q_proj": ("attn", "q"), "self_attn.k_proj": ("attn", "k"),
            "self_attn.v_proj": ("attn", "v"), "self_attn.o_proj": ("attn", "o"),
            "mlp.gate_proj": ("mlp", "gate"), "mlp.up_proj": ("mlp", "up"),
            "mlp.down_proj": ("mlp", "down"),
        }
    linear_shapes = {
        ("attn", "q"): (q_out, d), ("attn", "k"): (kv_out, d), ("attn", "v"): (kv_out, d),
        ("attn", "o"): (d, q_out), ("mlp", "gate"): (f, d), ("mlp", "up"): (f, d), ("mlp", "down"): (d, f),
    }
    out = dict(top)
    for layer in range(cfg.num_layers):
        for hf_name, ours in names.items():
            key = prefix.format(layer) + hf_name
            if ours in linear_shapes:
                shape = linear_shapes[ours]
                out[key + ".weight"] = Entry(("layers", layer, *ours, "kernel"), shape, True)
                if cfg.qkv_bias and ours[1] in "qkv":
                    out[key + ".bias"] = Entry(("layers", layer, *ours, "bias"), shape[:1], False)
            else:
                out[key] = Entry(("layers", layer, *ours), (d,), False)
    return out


def _shard_files(src: Path) -> dict[str, Path]:
    """tensor name -> file holding it, from the index if there is one, else from the headers."""
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (src / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        return {k: src / f for k, f in weight_map.items()}
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {src}")
    located = {}
    for file in files:
        with _open(file) as f:
            located.update({k: file for k in f.keys()})
    return located


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read {file.name}: truncated or not a safetensors file ({e})") from e


def _headers(files: set[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    found = {}
    for file in sorted(files):
        with _open(file) as f:
            for key in f.keys():
                found[key] = (file, tuple(f.get_slice(key).get_shape()))
    return found


def iter_params(
    src: str | Path,
    cfg: ModelConfig,
    dtype: np.dtype,
    progress: Callable[[list], Iterable] = lambda items: items,
) -> Iterator[tuple[ParamPath, np.ndarray]]:
    """Yield (our path, array in our layout and `dtype`) for every tensor of the HF checkpoint at src.

    Validates names and shapes from the headers first. Holds at most one source tensor and its
    converted copy at a time.
    """
    src = Path(src)
    expected = key_map(cfg)
    headers = _headers(set(_shard_files(src).values()))
    missing = sorted(set(expected) - set(headers))
    unexpected = sorted(set(headers) - set(expected))
    misshaped = [
        f"{k}: {headers[k][1]} (expected {expected[k].hf_shape})"
        for k in sorted(set(expected) & set(headers))
        if headers[k][1] != expected[k].hf_shape
    ]
    if missing or unexpected or misshaped:
        parts = [f"{label} ({len(items)}): {', '.join(items)}"
                 for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped))
                 if items]
        raise CheckpointError(f"checkpoint at {src} does not match its config.json ({cfg.family}): " + "; ".join(parts))
    by_file: dict[Path, list[str]] = {}
    for key in expected:
        by_file.setdefault(headers[key][0], []).append(key)
    work = [(file, key) for file, keys in sorted(by_file.items()) for key in keys]
    handles: dict[Path, object] = {}
    try:
        for file, key in progress(work):
            if file not in handles:
                handles.clear()  # one shard open at a time
                handles[file] = _open(file)
            try:
                tensor = handles[file].get_tensor(key)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read tensor {key} from {file.name}: {e}") from e
            entry = expected[key]
            array = tensor.T if entry.transpose else tensor
            del tensor
            yield entry.path, np.ascontiguousarray(array, dtype=dtype)
    finally:
        handles.clear()


NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}

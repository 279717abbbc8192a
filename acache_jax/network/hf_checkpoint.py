"""The HF LLaDA / Dream checkpoint layout, both ways: safetensors -> the tensors our parameters are
made of (what `load` and the converter read), and our parameters -> an HF directory (`export_hf`).
Our fused projections are several HF tensors each: q_proj, k_proj, v_proj (weights and biases) are
the parts of `attn.qkv`, gate_proj (LLaDA: ff_proj) and up_proj those of `mlp.gate_up`.

Every tensor name, shape, dtype and file is checked from the safetensors headers before any data is
read, so a bad checkpoint fails with one error that lists every problem, having loaded nothing.
Reading hands out the files' bytes untouched: at 8B size, transposing and casting on the host took
most of a load (52 of 69 s on an H200's host), and the device does both in milliseconds. Exports
write each file to a temporary name renamed into place, so `load` reads back exactly what was written.
"""

from __future__ import annotations

import json
import mmap
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from acache_jax.network.config import (DREAM_FIXED, GENERATION_CONFIG_FILE, LLADA_FIXED, DecodeConfig, InputError,
                                       ModelConfig, generation_config_json, read_json)
from acache_jax.network.files import write_atomic
from acache_jax.network.sharding import split_parts
from acache_jax.network.tokenizer import TOKENIZER_FILES

ParamPath = tuple  # e.g. ("layers", 3, "attn", "qkv", "kernel")
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(InputError):
    """The HF checkpoint is incomplete, inconsistent or unreadable."""


class Entry(NamedTuple):
    """Where one HF tensor goes: a parameter of ours, or one part of a fused one (the device builds
    the fused parameter of its parts: acache_jax.network.sharding.fuse_param; FUSED_PARTS lists them)."""

    path: ParamPath  # the parameter in our tree it is or is a part of
    hf_shape: tuple[int, ...]  # its shape in the HF file (PyTorch Linear: [out, in])
    transpose: bool  # Linear weights become [in, out] kernels
    part: str | None = None  # which part of the fused parameter at `path` ("q", "k", "v", "gate", "up"); None: all


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
        norms = {"attn_norm.weight": "attn_norm", "ff_norm.weight": "mlp_norm"}
        linears = {  # HF module -> (our module, its parameter, the part the HF one is)
            "q_proj": ("attn", "qkv", "q"), "k_proj": ("attn", "qkv", "k"), "v_proj": ("attn", "qkv", "v"),
            "attn_out": ("attn", "o", None), "ff_proj": ("mlp", "gate_up", "gate"), "up_proj": ("mlp", "gate_up", "up"),
            "ff_out": ("mlp", "down", None),
        }
    else:
        top = {
            "model.embed_tokens.weight": Entry(("embed",), (v, d), False),
            "model.norm.weight": Entry(("final_norm", "weight"), (d,), False),
            "lm_head.weight": Entry(("lm_head", "kernel"), (v, d), True),
        }
        prefix = "model.layers.{}."
        norms = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm"}
        linears = {
            "self_attn.q_proj": ("attn", "qkv", "q"), "self_attn.k_proj": ("attn", "qkv", "k"),
            "self_attn.v_proj": ("attn", "qkv", "v"), "self_attn.o_proj": ("attn", "o", None),
            "mlp.gate_proj": ("mlp", "gate_up", "gate"), "mlp.up_proj": ("mlp", "gate_up", "up"),
            "mlp.down_proj": ("mlp", "down", None),
        }
    shapes = {  # of each HF Linear weight, by the part it is or our module
        "q": (q_out, d), "k": (kv_out, d), "v": (kv_out, d), "o": (d, q_out), "gate": (f, d), "up": (f, d),
        "down": (d, f),
    }
    out = dict(top)
    for layer in range(cfg.num_layers):
        for hf_name, norm in norms.items():
            out[prefix.format(layer) + hf_name] = Entry(("layers", layer, norm, "weight"), (d,), False)
        for hf_name, (block, module, part) in linears.items():
            key, path = prefix.format(layer) + hf_name, ("layers", layer, block, module)
            shape = shapes[part or module]
            out[key + ".weight"] = Entry((*path, "kernel"), shape, True, part)
            if cfg.qkv_bias and module == "qkv":
                out[key + ".bias"] = Entry((*path, "bias"), shape[:1], False, part)
    return out


# Weight dtypes a checkpoint may store (safetensors names). Every other dtype of the format is
# refused at the header check: an integer, bool or unscaled fp8 tensor cast to float would load
# without an error and babble.
ST_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
ST_ITEMSIZE = {  # bytes per element of every safetensors dtype, to check the offsets of any tensor
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


class TensorInfo(NamedTuple):
    """Where one tensor's bytes lie in a safetensors file (from its header)."""

    file: Path
    dtype: str  # the safetensors dtype name (the supported ones: ST_DTYPES)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return ST_ITEMSIZE[self.dtype] * int(np.prod(self.shape))


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check that every tensor's bytes lie inside the file.

    Tensors are then mapped one by one (`map_tensor`), so that the map of a tensor in flight
    counts in RSS, not every touched page of the shard.
    """
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 + n:
                raise ValueError(f"header of {n} bytes but the file has {size}")
            header = json.loads(f.read(n))
        infos = {}
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            if meta["dtype"] not in ST_ITEMSIZE:
                raise ValueError(f"tensor {key} has an unknown dtype {meta['dtype']!r}")
            begin, end = meta["data_offsets"]
            info = TensorInfo(file, meta["dtype"], tuple(meta["shape"]), 8 + n + begin)
            if end - begin != info.nbytes or 8 + n + end > size:
                raise ValueError(f"tensor {key} needs bytes up to {8 + n + end}, the file has {size}")
            infos[key] = info
        return infos
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {file.name}: truncated or not a safetensors file ({e})") from e


def map_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor's bytes in place: a read-only array over a memory map of its own file region (the
    map goes when the array does, so only tensors in flight count in RSS). Nothing is copied on the
    host: the transfer to the device reads the page cache directly. Reading into a fresh buffer
    first cost an 8B load 7 s on an H200's host (page faults and a second copy) against 2 s to
    read the files. (Asking the kernel to read ahead, madvise WILLNEED, cost 10 s of an 8B load
    from the page cache: it walks every page of the region, on the thread that hands tensors out.)"""
    start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
    with open(info.file, "rb") as f:
        region = mmap.mmap(f.fileno(), info.offset + info.nbytes - start, access=mmap.ACCESS_READ, offset=start)
    count = info.nbytes // ST_ITEMSIZE[info.dtype]
    return np.frombuffer(region, ST_DTYPES[info.dtype], count, info.offset - start).reshape(info.shape)


def _headers(src: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint: the files named by the index if there is one, else all."""
    index = src / INDEX_FILE
    if index.is_file():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' object of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (src / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
        files = [src / f for f in files]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {src}")
    found: dict[str, TensorInfo] = {}
    for file in files:
        found.update(_read_header(file))
    return found


def checked_tensors(src: str | Path, cfg: ModelConfig) -> list[tuple[Entry, TensorInfo]]:
    """Every tensor `cfg` needs, in file order (shards are read front to back), checked from the
    headers alone: one error lists every missing, unexpected, misshaped or unsupported tensor."""
    src = Path(src)
    expected = key_map(cfg)
    headers = _headers(src)
    missing = sorted(set(expected) - set(headers))
    unexpected = sorted(set(headers) - set(expected))
    present = sorted(set(expected) & set(headers))
    misshaped = [f"{k}: {headers[k].shape} (expected {expected[k].hf_shape})"
                 for k in present if headers[k].shape != expected[k].hf_shape]
    unsupported = [f"{k}: {headers[k].dtype}" for k in present if headers[k].dtype not in ST_DTYPES]
    problems = (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped),
                (f"unsupported dtype, not one of {', '.join(ST_DTYPES)}", unsupported))
    if any(items for _, items in problems):
        parts = [f"{label} ({len(items)}): {', '.join(items)}" for label, items in problems if items]
        raise CheckpointError(f"checkpoint at {src} does not match its config.json ({cfg.family}): " + "; ".join(parts))
    return [(expected[k], headers[k]) for k in sorted(expected, key=lambda k: (headers[k].file, headers[k].offset))]


def stored_dtype(src: str | Path, cfg: ModelConfig) -> str:
    """The dtype the checkpoint's weights are stored in, as we hold them: "bfloat16" when every tensor
    is BF16, else "float32" (which holds F16, F32 and F64 weights exactly). From the headers: LLaDA's
    published config.json names no torch_dtype, and its weights are BF16."""
    dtypes = {info.dtype for _, info in checked_tensors(src, cfg)}
    return "bfloat16" if dtypes == {"BF16"} else "float32"


def iter_tensors(
    src: str | Path,
    cfg: ModelConfig,
    progress: Callable[[list], Iterable] = lambda items: items,
) -> Iterator[tuple[Entry, np.ndarray]]:
    """Yield (entry, tensor) for every tensor of the HF checkpoint at src as it is stored: the
    file's bytes, in the file's dtype and PyTorch layout, mapped rather than read (`map_tensor`).
    Nothing is transposed or cast on the host (the device does both as it receives each tensor:
    acache_jax.network.checkpoint). Names, shapes and dtypes are checked from the headers before any data
    is touched, and so are the files' sizes: a file cut short after that check would end the
    process when its missing bytes are touched (SIGBUS), a risk only a file changed while it loads
    runs."""
    for entry, info in progress(checked_tensors(src, cfg)):
        yield entry, map_tensor(info)


NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


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


def export_hf(dst: str | Path, cfg: ModelConfig, params: nnx.State, tokenizer_dir: str | Path | None = None,
              dtype: str = "bfloat16", generation: DecodeConfig | None = None) -> Path:
    """Write `params` (our layout) as an HF checkpoint of cfg's family into dst (created if needed).

    dtype: "bfloat16" or "float32" for the tensors. Tokenizer files found in tokenizer_dir are copied.
    generation: the model's generation defaults, written as generation_config.json.
    """

    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NUMPY_DTYPES)}, got {dtype!r}")
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tree = jax.device_get(nnx.to_pure_dict(params))
    tensors = {}
    parts: dict[ParamPath, dict[str, np.ndarray]] = {}  # each fused parameter's parts, split once
    for name, entry in key_map(cfg).items():
        array = tree
        for key in entry.path:
            array = array[key]
        if entry.part is not None:
            if entry.path not in parts:
                parts[entry.path] = split_parts(entry.path[-2], np.asarray(array), cfg.num_kv_heads, cfg.head_dim)
            array = parts[entry.path][entry.part]
        array = np.asarray(array).astype(NUMPY_DTYPES[dtype])
        tensors[name] = np.ascontiguousarray(array.T if entry.transpose else array)
        if tensors[name].shape != entry.hf_shape:
            raise ValueError(f"{name}: parameter of shape {tensors[name].shape}, the config needs {entry.hf_shape}")
    write_atomic(dst / "model.safetensors", lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    write_atomic(dst / "config.json", json.dumps(hf_config(cfg, dtype), indent=2))
    if generation is not None:
        write_atomic(dst / GENERATION_CONFIG_FILE, json.dumps(generation_config_json(generation, cfg), indent=2))
    if tokenizer_dir is not None and Path(tokenizer_dir).resolve() != dst.resolve():
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, dst / name)
    return dst

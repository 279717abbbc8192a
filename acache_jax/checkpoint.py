"""Our checkpoint format and `load`, which accepts it or an HF snapshot directory.

A converted checkpoint is a directory holding the HF `config.json` (the single source of the model
config), `acache.json` (format marker and dtype), `params/` (orbax-checkpoint) and the tokenizer files.
It is written to a sibling temporary directory and renamed into place, so a failed write leaves nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from acache_jax.config import ModelConfig
from acache_jax.model import Model, abstract_transformer

FORMAT_FILE = "acache.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _dtype_name(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name}")
    return name


def _nest(flat: Iterable[tuple[tuple, Any]]) -> dict:
    """{("layers", 0, "attn", ...): a} -> nested dict with string keys (orbax wants strings)."""
    tree: dict = {}
    for path, value in flat:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        node[str(path[-1])] = value
    return tree


def _unstring_layers(tree: dict) -> dict:
    return {**tree, "layers": {int(k): v for k, v in tree["layers"].items()}}


def is_converted(path: str | Path) -> bool:
    return (Path(path) / FORMAT_FILE).is_file()


def check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"destination {dst} exists and is not an empty directory; refusing to overwrite")


def save(
    dst: str | Path,
    hf_config: dict,
    params: Iterable[tuple[tuple, np.ndarray]],
    dtype: Any,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a converted checkpoint atomically. `params` yields (our param path, array) pairs."""
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    check_destination(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        # Leaves as jax arrays (orbax stages a copy of numpy leaves), written uncompressed and at
        # most 1 GB at a time (compression buffers every array): peak memory stays near the output.
        tree = _nest((path, jnp.asarray(array)) for path, array in params)
        handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=1, use_compression=False)
        ocp.Checkpointer(handler).save(tmp / "params", args=ocp.args.PyTreeSave(tree))
        del tree
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        (tmp / FORMAT_FILE).write_text(json.dumps({"format": FORMAT_VERSION, "dtype": _dtype_name(dtype)}))
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
        check_destination(dst)
        if dst.exists():
            dst.rmdir()
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _restore_converted(path: Path, cfg: ModelConfig, dtype: Any | None) -> dict:
    import orbax.checkpoint as ocp

    stored = json.loads((path / FORMAT_FILE).read_text())["dtype"]
    dtype = DTYPES[_dtype_name(stored if dtype is None else dtype)]
    _, abstract = nnx.split(abstract_transformer(cfg, DTYPES[stored]))
    target = _nest(_flatten(nnx.to_pure_dict(abstract)))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), target)
    tree = ocp.StandardCheckpointer().restore(path / "params", target)
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), _unstring_layers(tree))


def _flatten(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(_flatten(value, prefix + (key,)))
        else:
            out.append((prefix + (key,), value))
    return out


def _read_hf(path: Path, cfg: ModelConfig, dtype: Any | None) -> dict:
    from convert.hf_layout import NUMPY_DTYPES, iter_params

    if dtype is None:
        torch_dtype = json.loads((path / "config.json").read_text()).get("torch_dtype")
        dtype = "bfloat16" if torch_dtype == "bfloat16" else "float32"
    params = iter_params(path, cfg, NUMPY_DTYPES[_dtype_name(dtype)], progress(f"loading {path.name}"))
    return _unstring_layers(_nest((p, jnp.asarray(a)) for p, a in params))


def progress(desc: str):
    """A tqdm progress bar over an iterable of known length (hidden when stderr is not a terminal)."""
    from tqdm.auto import tqdm

    return lambda items: tqdm(items, desc=desc, unit="tensor", disable=None)


def load_tokenizer(path: str | Path) -> Any | None:
    """The HF fast tokenizer shipped in `path` (tokenizer.json + tokenizer_config.json), or None."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))


def load(path: str | Path, dtype: Any | None = None) -> Model:
    """Load a model from a converted checkpoint or an HF LLaDA/Dream snapshot directory.

    dtype: "float32" or "bfloat16" (or the jnp dtype); default: the dtype the weights are stored in.
    An HF directory is converted in memory, one tensor at a time.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_file(path)
    tree = _restore_converted(path, cfg, dtype) if is_converted(path) else _read_hf(path, cfg, dtype)
    graphdef, state = nnx.split(abstract_transformer(cfg, tree["embed"].dtype))
    nnx.replace_by_pure_dict(state, tree)
    return Model(cfg, graphdef, state, load_tokenizer(path))

"""Our checkpoint format and `load`, which accepts it or an HF snapshot directory.

A converted checkpoint is a directory holding the HF `config.json` (the single source of the model
config), `acache.json` (format marker and dtype), `params/` (orbax-checkpoint: our parameter tree,
its fused projections laid out for no KV-head copies), the tokenizer files and
`generation_config.json`. It is written to a hidden sibling directory renamed into place, so a
failed or interrupted write leaves nothing at the destination; a later write removes what an
interrupted one left beside it.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from acache_jax import compile_cache
from acache_jax.network.config import GENERATION_CONFIG_FILE, InputError, ModelConfig, read_generation_config, read_json
from acache_jax.network.files import partial_name, remove_stale_partials
from acache_jax.network.hf_checkpoint import (ST_DTYPES, CheckpointError, Entry, checked_tensors, iter_tensors,
                                              stored_dtype)
from acache_jax.network.model import Model, abstract_transformer
from acache_jax.network.sharding import (FUSED_PARTS, compiling_ahead, fuse_param, is_qkv, kv_copies, load_programs,
                                         param_sharding, place_param, sharded_config,
                                         transfer_param)
from acache_jax.network.tokenizer import TOKENIZER_FILES, LazyTokenizer, ships_tokenizer

FORMAT_FILE = "acache.json"
FORMAT_VERSION = 2  # 1: q/k/v and gate/up stored apart (before the fused projections); not read
CARRIED_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG_FILE)  # copied as they are into a converted checkpoint
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


SAVE_IN_FLIGHT_BYTES = 1 << 30  # what the parameter write may hold in flight (raised to the largest tensor)


def save(
    dst: str | Path,
    hf_config: dict,
    params: Iterable[tuple[tuple, np.ndarray | jax.Array]],
    dtype: Any,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a converted checkpoint atomically. `params` yields (our param path, array) pairs."""
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    check_destination(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    for leftover in remove_stale_partials(dst):
        print(f"removed {leftover.name}, left beside {dst.name} by an interrupted write", file=sys.stderr)
    tmp = partial_name(dst)
    try:  # the mkdir inside: a signal just after it would otherwise skip the cleanup
        tmp.mkdir()
        # Leaves as jax arrays (orbax stages a copy of numpy leaves), written uncompressed
        # (compression buffers every array), copied from the device and written SAVE_IN_FLIGHT_BYTES
        # at a time: peak host memory stays near the output (on a GPU, near the in-flight bytes;
        # unbounded, an 8B conversion on an H200 staged the whole model: 24 GB). Orbax refuses a
        # tensor larger than its in-flight limit (an 8B model's 1 GB embedding), so the limit is at
        # least the largest tensor.
        tree = _nest((path, jnp.asarray(array)) for path, array in params)
        largest = max(leaf.nbytes for leaf in jax.tree.leaves(tree))
        in_flight = max(SAVE_IN_FLIGHT_BYTES, largest + 1)
        handler = ocp.PyTreeCheckpointHandler(handler_impl=ocp.BasePyTreeCheckpointHandler(
            save_concurrent_bytes=in_flight, save_device_host_concurrent_bytes=in_flight, use_compression=False))
        ocp.Checkpointer(handler).save(tmp / "params", args=ocp.args.PyTreeSave(tree))
        del tree
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted((tmp / "params").rglob("*")) if f.is_file()}
        (tmp / FORMAT_FILE).write_text(json.dumps({"format": FORMAT_VERSION, "dtype": _dtype_name(dtype),
                                                   "files": files}))
        if tokenizer_dir is not None:
            for name in CARRIED_FILES:
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


RESTORE_THREADS = 3  # groups of a converted directory's parameters read at once


def _restore_converted(path: Path, cfg: ModelConfig, dtype: Any | None, mesh: Mesh | None) -> dict:
    """The stored parameters, placed as a snapshot's are (uncommitted on one device, so that both
    formats run the same programs); on a mesh each leaf is restored straight into its shards
    (qkv leaves, when KV heads are copied, come to host memory first, to be re-laid out and placed)."""
    import orbax.checkpoint as ocp

    marker = read_json(path / FORMAT_FILE)
    marker = marker if isinstance(marker, dict) else {}
    version = marker.get("format")
    if version != FORMAT_VERSION:
        older = isinstance(version, int) and version < FORMAT_VERSION
        raise CheckpointError(f"{path} was written by {'an older' if older else 'another'} version of acache-jax "
                              f"(checkpoint format {version!r}; this version reads format {FORMAT_VERSION}, with "
                              "fused q/k/v and gate/up weights): convert the model again from its HF snapshot "
                              "(python -m convert SRC_DIR DST_DIR)")
    stored = marker.get("dtype")
    if stored not in DTYPES:
        raise CheckpointError(f"{path / FORMAT_FILE} names no known dtype ({sorted(DTYPES)}): {stored!r}")
    dtype = DTYPES[_dtype_name(stored if dtype is None else dtype)]
    _, abstract = _abstract_model(cfg, DTYPES[stored])
    target = _nest(_flatten(nnx.to_pure_dict(abstract)))
    copies = 1 if mesh is None else kv_copies(cfg, mesh.shape["model"])

    def leaf_target(leaf_path, a):
        keys = tuple(k.key for k in leaf_path)
        if mesh is None:
            return jax.ShapeDtypeStruct(a.shape, a.dtype)
        if copies > 1 and is_qkv(keys):
            return np.empty(a.shape, a.dtype)  # restored to host memory, then re-laid out and placed
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=param_sharding(mesh, keys))

    target = jax.tree_util.tree_map_with_path(leaf_target, target)
    # The files the write left (sizes recorded in acache.json): a damaged directory is named here,
    # before orbax, whose failures come as pages of TensorStore text and event-loop tracebacks.
    damaged = [name for name, size in marker.get("files", {}).items()
               if not (path / name).is_file() or (path / name).stat().st_size != size]
    if damaged or not (path / "params").is_dir():
        raise CheckpointError(f"{path} is damaged: {len(damaged) or 'all'} parameter files missing or truncated "
                              f"({', '.join(damaged[:3]) or 'params/'}{', ...' if len(damaged) > 3 else ''}); "
                              "convert the model again")
    # Reads in flight bounded as the write's are (orbax's default is 96 GB: an 8B restore on an H200
    # held 23 GB of host memory for a 16 GB model); the bound must exceed the largest tensor.
    largest = max(map(_nbytes, jax.tree.leaves(target)))
    in_flight = max(SAVE_IN_FLIGHT_BYTES, largest + 1)
    in_flight_gb = -(-in_flight // 10**9)

    def restore(handler, args):
        try:
            return ocp.Checkpointer(handler).restore((path / "params").absolute(), args=args)
        except Exception as e:  # orbax raises many kinds (NOT_FOUND, ValueError, KeyError, ...) with long texts
            raise CheckpointError(f"cannot restore the parameters in {path / 'params'}: files missing or damaged "
                                  f"({type(e).__name__}); convert the model again") from None

    if mesh is None:
        # Orbax's arrays come back committed to their device, a snapshot's are placed uncommitted
        # (place_param), and committed weights change every program that takes them: a converted
        # directory's runs missed the snapshot's compilation cache entries, and its engine compiled its
        # warmed-up steps again. So the leaves come to host memory, `in_flight` bytes at a time, and
        # are placed as a snapshot's are. RESTORE_THREADS groups are read at once while one is
        # placed, so the host holds at most RESTORE_THREADS + 1. Orbax reads one group at about
        # 2 GB/s: a converted LLaDA-8B loaded in 8.1 s reading one group at a time, 5.8 s reading
        # three (an H100, warm page cache).
        handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=in_flight_gb)

        def read(group: list[tuple[tuple, Any]]) -> dict:
            item = _nest((p, np.empty(a.shape, a.dtype)) for p, a in group)
            return restore(handler, ocp.args.PyTreeRestore(
                item, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item),
                partial_restore=True))

        placed: list[tuple[tuple, jax.Array]] = []
        groups = _groups(_flatten(target), in_flight)
        with ThreadPoolExecutor(RESTORE_THREADS, thread_name_prefix="restore-weights") as reader:
            reading = deque(reader.submit(read, group) for group in itertools.islice(groups, RESTORE_THREADS))
            while reading:
                host = reading.popleft().result()
                if (following := next(groups, None)) is not None:
                    reading.append(reader.submit(read, following))
                group_placed = [(p, place_param(p, a, cfg, None, dtype)) for p, a in _flatten(host)]
                del host
                jax.block_until_ready([a for _, a in group_placed])  # the group's host memory is free after this
                placed += group_placed
        return _unstring_layers(_nest(placed))
    tree = restore(ocp.StandardCheckpointHandler(restore_concurrent_gb=in_flight_gb), ocp.args.StandardRestore(target))
    return _unstring_layers(_nest((p, place_param(p, a, cfg, mesh, dtype)) for p, a in _flatten(tree)))


def _groups(flat: list[tuple[tuple, Any]], limit: int) -> Iterator[list[tuple[tuple, Any]]]:
    """Consecutive (path, array-like) entries, a group of at most `limit` bytes at a time (a larger entry alone)."""
    group, size = [], 0
    for entry in flat:
        nbytes = _nbytes(entry[1])
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append(entry)
        size += nbytes
    if group:
        yield group


def _nbytes(a: Any) -> int:
    """Bytes of an array or of a shape-only stand-in (ShapeDtypeStruct, np.empty target)."""
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def _flatten(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(_flatten(value, prefix + (key,)))
        else:
            out.append((prefix + (key,), value))
    return out


IN_FLIGHT_BYTES = 1 << 30  # tensors being placed at once (at least one): what loading adds to device memory
PLACE_THREADS = 4  # transfers from pageable host memory go faster several at a time


def read_hf(path: Path, cfg: ModelConfig, dtype: Any, mesh: Mesh | None = None,
            desc: str = "loading") -> Iterator[tuple[tuple, jax.Array]]:
    """(our param path, device array in our layout) for every parameter of an HF snapshot: the host
    maps the files' bytes and copies them to the device as they are (`transfer_param`, a few
    tensors at once on threads), and the device transposes and casts them (`place_param`, on a
    thread of its own, in file order).

    The two stages are apart so that the copies go on while a relayout waits for its program,
    which compiles or is read from the compilation cache meanwhile (`compiling_ahead`): an 8B load
    spent most of a second with its placing threads waiting on that lock while a gigabyte was in
    flight. Bytes on the device waiting for their relayout are the model's own (their parameter
    replaces them), so the bound is on what loading adds: copies in flight, plus what a waiting
    tensor stored in a wider dtype holds beyond its parameter, stay within IN_FLIGHT_BYTES (or one
    tensor, if larger). Unbounded, an 8B load peaked at twice the model on the device.

    A relaid-out tensor is handed out, or, if it is a part of a fused parameter (q/k/v, gate/up:
    `Entry.part`), held on the device until its siblings are done too; the device then builds the
    parameter (`fuse_param`, on the relayout thread too, as its program may still be compiling),
    which is handed out in their place, and the parts go. Siblings are often neighbours in the
    files, but need not be (LLaDA-8B's shards hold every layer's q_proj, then every k_proj, ...):
    held parts are bytes of the model too, so the device holds at most the model, the bytes in
    flight and one tensor being relaid out or one parameter being fused."""
    item = jnp.dtype(dtype).itemsize
    held: dict[tuple, dict[str, jax.Array]] = {}  # fused parameter path -> its parts done so far

    def settle(entry: Entry, array: jax.Array) -> tuple[tuple, jax.Array] | None:  # on the relayout thread
        array = place_param(entry.path, array, cfg, mesh, dtype, transposed=entry.transpose,
                            part=entry.part).block_until_ready()
        if entry.part is None:
            return entry.path, array
        parts = held.setdefault(entry.path, {})
        parts[entry.part] = array
        del array
        names = FUSED_PARTS[entry.path[-2]]
        if len(parts) < len(names):
            return None
        del held[entry.path]
        return entry.path, fuse_param(entry.path, [parts.pop(name) for name in names], cfg, mesh).block_until_ready()

    with (ThreadPoolExecutor(PLACE_THREADS, thread_name_prefix="place-weights") as copying,
          ThreadPoolExecutor(1, thread_name_prefix="relayout-weights") as relayout):
        copies: deque[tuple[Entry, int, Future]] = deque()  # (entry, bytes in flight, its transfer)
        relayouts: deque[tuple[int, Future]] = deque()  # (bytes beyond its parameter, its relayout)
        in_flight = 0

        def copied() -> None:  # the oldest copy is on the device: queue its relayout
            nonlocal in_flight
            entry, nbytes, future = copies.popleft()
            array = future.result().block_until_ready()
            extra = max(0, array.nbytes - array.size * item)
            in_flight += extra - nbytes
            relayouts.append((extra, relayout.submit(settle, entry, array)))

        def done() -> Iterator[tuple[tuple, jax.Array]]:  # the oldest relayout: a parameter, or a part held
            nonlocal in_flight
            extra, future = relayouts.popleft()
            param = future.result()
            in_flight -= extra
            if param is not None:
                yield param

        try:
            for entry, tensor in iter_tensors(path, cfg, progress(f"{desc} {path.name}")):
                while in_flight and in_flight + tensor.nbytes > IN_FLIGHT_BYTES:
                    if copies:
                        copied()
                    else:
                        yield from done()
                while relayouts and relayouts[0][1].done():
                    yield from done()
                copies.append((entry, tensor.nbytes, copying.submit(
                    transfer_param, entry.path, tensor, cfg, mesh, dtype, transposed=entry.transpose,
                    part=entry.part)))
                in_flight += tensor.nbytes
                del tensor  # the map goes once its transfer is done
            while copies:
                copied()
            while relayouts:
                yield from done()
            assert not held, f"parts without all their siblings: {sorted(held)}"  # key_map lists every part
        finally:
            for future in (*(f for _, _, f in copies), *(f for _, f in relayouts)):
                future.cancel()


def _read_hf(path: Path, cfg: ModelConfig, dtype: Any | None, mesh: Mesh | None) -> dict:
    """The snapshot's parameters, placed; the programs placing them and `load`'s finiteness check
    compile on a thread of their own meanwhile (`compiling_ahead`: while the files are read)."""
    dtype = DTYPES[_dtype_name(stored_dtype(path, cfg) if dtype is None else dtype)]
    tensors = [(e.path, info.shape, ST_DTYPES[info.dtype], e.transpose, e.part)
               for e, info in checked_tensors(path, cfg)]

    def programs():  # taken on the compiling thread, which builds the abstract model `load` uses
        yield from load_programs(tensors, cfg, mesh, dtype)
        _, abstract = _abstract_model(sharded_config(cfg, mesh), dtype)
        yield _all_finite, ([a if mesh is None else jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                          sharding=param_sharding(mesh, p))
                             for p, a in _finite_order(_flatten(nnx.to_pure_dict(abstract)))],)

    with compiling_ahead(programs()):
        return _unstring_layers(_nest(read_hf(path, cfg, dtype, mesh)))


def progress(desc: str):
    """A tqdm progress bar over an iterable of known length (hidden when stderr is not a terminal)."""
    from tqdm.auto import tqdm

    return lambda items: tqdm(items, desc=desc, unit="tensor", disable=None)


def _abstract_model(cfg: ModelConfig, dtype: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """The network's (graphdef, shape-only state), built once per config and dtype: 0.15 s at 8B
    size, which a snapshot's load spends on its compiling thread, not after the read. Callers copy
    the state before filling it."""
    return _abstract_split(cfg, jnp.dtype(dtype))


@functools.lru_cache(maxsize=4)
def _abstract_split(cfg: ModelConfig, dtype: np.dtype) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(abstract_transformer(cfg, dtype))


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.isfinite(a).all() for a in leaves])


def _finite_order(flat: list[tuple[tuple, Any]]) -> list[tuple[tuple, Any]]:
    """`_check_finite`'s order of the leaves: one program for either format (whose layer keys are
    strings or ints) and for the abstract tree `_read_hf` compiles it ahead for."""
    return sorted(flat, key=lambda item: [str(k) for k in item[0]])


def _check_finite(tree: dict) -> None:
    """Name the first parameter holding NaN or inf (one fused reduction, one transfer)."""
    flat = _finite_order(_flatten(tree))
    finite = jax.device_get(_all_finite([a for _, a in flat]))
    bad = [".".join(map(str, p)) for (p, _), ok in zip(flat, finite) if not ok]
    if bad:
        raise CheckpointError(f"parameters hold NaN or inf values: {', '.join(bad[:5])}"
                              f"{f' and {len(bad) - 5} more' if len(bad) > 5 else ''} (a damaged checkpoint?)")


def load(path: str | Path, dtype: Any | None = None, mesh: Mesh | None = None) -> Model:
    """Load a model from a converted checkpoint or an HF LLaDA/Dream snapshot directory.

    dtype: "float32" or "bfloat16" (or the jnp dtype); default: the dtype the weights are stored in.
    mesh: a (data, model) mesh (`acache_jax.network.sharding.make_mesh`) to split the model over; each
    tensor goes from the host straight to its shards as it is read (no device ever holds a whole
    split tensor), and every entry point then runs the model on the mesh. With fewer KV heads
    than the tensor-parallel size, the KV heads are copied (acache_jax/network/sharding.py).
    An HF directory is converted in memory, one tensor at a time. The directory's
    generation_config.json (if any) becomes the model's generation defaults. The tokenizer (if the
    directory ships one) is loaded at its first use, where a damaged tokenizer file raises its
    TokenizerError (acache_jax.network.tokenizer.LazyTokenizer).
    The first load turns on JAX's persistent compilation cache in the user's cache directory, unless
    jax's own cache is configured or ACACHE_JAX_COMPILE_CACHE=off (acache_jax/compile_cache.py).
    """
    path = Path(path)
    if path.is_file():
        raise InputError(f"{path} is a file; a model is a directory (config.json, weights, tokenizer files)")
    if not path.is_dir():
        raise InputError(f"model directory {path} does not exist")
    if dtype is not None:
        try:
            _dtype_name(dtype)
        except (TypeError, ValueError):
            raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None
    cfg = ModelConfig.from_file(path)
    placed_cfg = sharded_config(cfg, mesh)  # checks the mesh before anything is read
    generation, eos_ids = read_generation_config(path, cfg)
    compile_cache.enable()  # library users too: see acache_jax/compile_cache.py (no-op once decided)
    tree = _restore_converted(path, cfg, dtype, mesh) if is_converted(path) else _read_hf(path, cfg, dtype, mesh)
    _check_finite(tree)
    graphdef, state = _abstract_model(placed_cfg, tree["embed"].dtype)
    state = jax.tree.map(lambda a: a, state)  # filled below: a copy, not the cached one
    nnx.replace_by_pure_dict(state, tree)
    source = path / GENERATION_CONFIG_FILE
    tokenizer = LazyTokenizer(path) if ships_tokenizer(path) else None  # loaded where first used
    return Model(placed_cfg, graphdef, state, tokenizer, generation, eos_ids, mesh,
                 source if source.is_file() else None)

"""Tensor and data parallelism over a device mesh: the mesh, and where each array lives on it.

The mesh has two axes, `data` (copies of the weights, each running part of the batch) and
`model` (each device holds a slice of every weight: Megatron-style tensor parallelism, left to
XLA's SPMD partitioner). Which mesh axis each logical axis of an array uses is said once, in
`ShardingRules`; parameters, KV pools and affix caches declare their logical axes here, so that
changing the parallel strategy means changing the rules, not the model.

KV heads are split over `model` with the query heads they serve. When a model has fewer KV heads
than the tensor-parallel size (GQA, e.g. Dream-7B's 4 on 8 devices), each KV head is stored
`tp / kv_heads` times, one copy per device that needs it (as vLLM does): the loaded model's
`config.num_kv_heads` becomes tp, its qkv projection holds tp groups, each with a copy of its KV
head, and query head h still reads a copy of KV head h // (num_heads / kv_heads) of the checkpoint.

The q, k and v projections are one fused weight (`qkv`), the MLP's gate and up another (`gate_up`):
one matmul each instead of three and two. Their column layouts (`fuse_qkv`, `fuse_gate_up`) are
owned here, because they are chosen so that splitting the columns over `model` gives each device
whole KV-head groups and whole gate/up pairs; checkpoints store the parts, which loading fuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from acache_jax.network.config import ConfigError, InputError, ModelConfig

MESH_AXES = ("data", "model")


class MeshError(ConfigError):
    """A mesh this model or these devices cannot run."""


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The mesh axis of each logical axis (None: replicated).

    The fused qkv projection is split by KV-head group (a device holds whole groups: query heads
    with the K and V they read) and the MLP's fused gate_up by hidden unit (column-parallel), o
    and down on their input (row-parallel): each layer needs one all-reduce after attention and one
    after the MLP, and attention itself is local to a device's heads. The vocabulary is split in the
    embedding table and the LM head (logits come out split by vocabulary). Pool slots are not
    split: any request may read any slot, and a slot of the static path's pool belongs to no
    fixed batch shard (the affix rows are shared by every row).
    """

    batch: str | None = "data"
    heads: str | None = "model"
    kv_heads: str | None = "model"
    mlp: str | None = "model"
    vocab: str | None = "model"
    embed: str | None = None
    head_dim: str | None = None
    slots: str | None = None

    def spec(self, axes: Sequence[str | None]) -> P:
        return P(*(None if a is None else getattr(self, a) for a in axes))


RULES = ShardingRules()

# Logical axes of each parameter, by (module, leaf) name; kernels are [in, out].
PARAM_AXES = {
    ("qkv", "kernel"): ("embed", "kv_heads"), ("qkv", "bias"): ("kv_heads",),  # split by KV-head group
    ("o", "kernel"): ("heads", "embed"),
    ("gate_up", "kernel"): ("embed", "mlp"), ("down", "kernel"): ("mlp", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
}
EMBED_AXES = ("vocab", "embed")  # the embedding table
NORM_AXES = ("embed",)
KV_AXES = ("slots", "kv_heads", "head_dim")  # a pool's or an affix cache's rows, per layer
ROWS_AXES = ("batch",)  # the leading axis of a static batch's arrays


def param_axes(path: Sequence[Any]) -> tuple[str | None, ...]:
    """Logical axes of the parameter at `path` (e.g. ("layers", 0, "attn", "qkv", "kernel"))."""
    names = tuple(str(p) for p in path)
    if names == ("embed",):
        return EMBED_AXES
    if names[-1] == "weight":  # RMSNorm
        return NORM_AXES
    return PARAM_AXES[names[-2:]]


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, model) mesh over the first tensor_parallel x data_parallel devices (default: all of
    jax.devices(), every host's): neighbouring devices form a model group, as NVLink wants."""
    for name, n in (("tensor_parallel", tensor_parallel), ("data_parallel", data_parallel)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise MeshError(f"{name} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    wanted = tensor_parallel * data_parallel
    if wanted > len(devices):
        raise MeshError(f"tensor parallel {tensor_parallel} x data parallel {data_parallel} = {wanted} devices, "
                        f"but only {len(devices)} are present")
    grid = np.asarray(devices[:wanted], dtype=object).reshape(data_parallel, tensor_parallel)
    return Mesh(grid, MESH_AXES)


def tensor_parallel_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["model"]


def kv_copies(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is stored so that `tp` devices each hold whole KV heads."""
    return max(1, tp // cfg.num_kv_heads)


def check_mesh(mesh: Mesh, cfg: ModelConfig) -> None:
    """One clear error for a mesh the model cannot be split over."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise MeshError(f"the mesh must have axes {MESH_AXES} (acache_jax.network.sharding.make_mesh), "
                        f"got {mesh.axis_names}")
    tp = tensor_parallel_size(mesh)
    sizes = (("attention heads", cfg.num_heads), ("MLP hidden size", cfg.intermediate_size),
             ("vocabulary", cfg.vocab_size))
    for what, n in sizes:
        if n % tp:
            raise MeshError(f"tensor parallel size {tp} does not divide the model's {what} ({n})")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise MeshError(f"tensor parallel size {tp} must divide the model's {kv} KV heads or be a multiple of them")
    # Hence whole groups of the fused layouts on each device: kv % tp == 0 (no copies) splits the kv
    # groups evenly; tp = kv * copies gives one group a device, its num_heads / tp query heads whole
    # since tp divides the heads; and tp divides the MLP size, so each device holds whole gate/up pairs.


def sharded_config(cfg: ModelConfig, mesh: Mesh | None) -> ModelConfig:
    """The config of the model as placed on `mesh`: with its KV heads stored `kv_copies` times."""
    if mesh is None:
        return cfg
    check_mesh(mesh, cfg)
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * kv_copies(cfg, tensor_parallel_size(mesh)))


def param_sharding(mesh: Mesh, path: Sequence[Any]) -> NamedSharding:
    return NamedSharding(mesh, RULES.spec(param_axes(path)))


def is_qkv(path: Sequence[Any]) -> bool:
    """Whether the parameter at `path` is a fused q/k/v projection leaf (its layout depends on the KV copies)."""
    return len(path) >= 2 and str(path[-2]) == "qkv"


def repeat_kv_heads(array: Any, kv_heads: int, head_dim: int, copies: int) -> Any:
    """A K/V projection leaf ([..., kv_heads * head_dim]) with each KV head repeated `copies` times
    in place: head j of the result is head j // copies of the checkpoint. Traceable: loading runs
    it on the device."""
    if copies == 1:
        return array
    heads = array.reshape(*array.shape[:-1], kv_heads, head_dim)
    return jnp.repeat(heads, copies, axis=-2).reshape(*array.shape[:-1], -1)


# The fused parameters' modules and the checkpoint tensors they are made of, in order (Entry.part names one).
FUSED_PARTS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def fuse_qkv(q: Any, k: Any, v: Any, kv_heads: int, head_dim: int, copies: int = 1) -> jax.Array:
    """The fused q/k/v projection leaf (kernel [D, N] or bias [N]) from the checkpoint's q
    [..., heads * head_dim] and k, v [..., kv_heads * head_dim]: kv_heads * copies groups of columns,
    group j holding its G = heads / (kv_heads * copies) query heads j*G .. j*G+G-1, then k and v of
    checkpoint KV head j // copies (`repeat_kv_heads`), head_dim columns each. Query head h is thus
    in group h // G, the KV head attention reads for it, and an even split of the columns over
    `model` gives each device whole groups. Traceable: loading runs it on the device."""
    groups, lead = kv_heads * copies, q.shape[:-1]
    k, v = (repeat_kv_heads(a, kv_heads, head_dim, copies).reshape(*lead, groups, 1, head_dim) for a in (k, v))
    return jnp.concatenate([q.reshape(*lead, groups, -1, head_dim), k, v], axis=-2).reshape(*lead, -1)


def split_qkv(qkv: Any, kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
    """(q [..., heads * head_dim], k, v [..., kv_heads * head_dim]) of a fused q/k/v leaf or of its
    matmul's output, laid out by `fuse_qkv` for `kv_heads` groups (the placed config's KV heads).
    Reshapes and slices only: numpy arrays stay numpy."""
    lead = qkv.shape[:-1]
    y = qkv.reshape(*lead, kv_heads, -1, head_dim)
    return y[..., :-2, :].reshape(*lead, -1), y[..., -2, :].reshape(*lead, -1), y[..., -1, :].reshape(*lead, -1)


def fuse_gate_up(gate: Any, up: Any) -> jax.Array:
    """The fused gate/up kernel [D, 2F] from gate and up [D, F]: columns in pairs (gate_f, up_f), so
    that an even split over `model` gives each device whole pairs, whatever its size. Traceable."""
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def split_gate_up(gate_up: Any) -> tuple[Any, Any]:
    """(gate, up) [..., F] of a fused gate/up kernel or of its matmul's output (numpy stays numpy)."""
    pairs = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
    return pairs[..., 0], pairs[..., 1]


def fuse_parts(module: str, parts: Sequence[Any], kv_heads: int, head_dim: int, copies: int = 1) -> jax.Array:
    """The fused leaf of `module` ("qkv" or "gate_up") from its parts in FUSED_PARTS order."""
    return fuse_qkv(*parts, kv_heads, head_dim, copies) if module == "qkv" else fuse_gate_up(*parts)


def split_parts(module: str, leaf: Any, kv_heads: int, head_dim: int) -> dict[str, Any]:
    """Part name -> part of a fused leaf of `module` (the inverse of `fuse_parts` with copies 1)."""
    parts = split_qkv(leaf, kv_heads, head_dim) if module == "qkv" else split_gate_up(leaf)
    return dict(zip(FUSED_PARTS[module], parts, strict=True))


def place_param(path: Sequence[Any], array: np.ndarray | jax.Array, cfg: ModelConfig, mesh: Mesh | None,
                dtype: Any, transposed: bool = False, part: str | None = None) -> jax.Array:
    """One parameter, or one part of a fused one, onto the device (or its shards on `mesh`), in our
    layout and `dtype`; `cfg` is the checkpoint's (KV heads not copied).

    `array` holds a checkpoint's bytes as read (host memory; `transposed`: PyTorch's [out, in]
    layout of an [in, out] kernel) or an array already placed. The host only copies bytes: the
    transpose, the cast and the KV-head copies run on the device, where they take microseconds
    (on the host they cost most of an 8B model's load). On a mesh each device receives only its
    own slice of the stored tensor (no device ever holds a whole split tensor), except where KV
    heads are copied (`kv_copies` > 1): the k and v parts, which are small, and a whole qkv leaf of
    a converted checkpoint (stored without copies), which is re-laid out for the copies here.

    part: which part of the fused parameter at `path` `array` is (FUSED_PARTS; `fuse_param` then
    builds the parameter). A part is split over `model` as its parameter's columns are, so that each
    device receives the parts of its own groups or hidden units and the fusion is local: q by query
    head, k and v by KV head (whole on every device when copied), gate and up by hidden unit.
    """
    plan = _placing(path, array.dtype, cfg, mesh, dtype, transposed, part)
    if not isinstance(array, jax.Array):
        array = _transfer(array, plan.source)
    return array if plan.program is None else _call(plan.program, array)


def transfer_param(path: Sequence[Any], array: np.ndarray, cfg: ModelConfig, mesh: Mesh | None, dtype: Any,
                   transposed: bool = False, part: str | None = None) -> jax.Array:
    """A checkpoint's bytes as read (`place_param`'s arguments) copied to the device as they are,
    where `place_param` then lays them out. Apart so that a loader can go on copying while a
    relayout waits for its program to compile (`compiling_ahead`)."""
    return _transfer(array, _placing(path, array.dtype, cfg, mesh, dtype, transposed, part).source)


def _transfer(host: np.ndarray, source: NamedSharding | None) -> jax.Array:
    if source is None:  # uncommitted: inputs made later (uncommitted too) then run the same programs
        return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, source, lambda index: host[index])


class _Placing(NamedTuple):
    source: NamedSharding | None  # where the stored bytes go (None: uncommitted, on the default device)
    program: Any | None  # the device's relayout of them (None: they are the parameter)
    target: NamedSharding | None  # the placed parameter's (or part's) sharding; None: uncommitted


def _placing(path: Sequence[Any], stored: Any, cfg: ModelConfig, mesh: Mesh | None, dtype: Any, transposed: bool,
             part: str | None) -> _Placing:
    """How `place_param` places a tensor of dtype `stored` (and `load_programs` foresees it)."""
    copies, target = _copies_and_sharding(path, cfg, mesh)
    if target is not None and copies > 1 and part in ("k", "v"):
        target = NamedSharding(mesh, P())  # fewer KV heads than devices: whole, copied by fuse_param
    regroup = copies if part is None else 1  # a whole qkv leaf laid out for no copies
    source = None if mesh is None else NamedSharding(
        mesh, P() if regroup > 1 else P(*reversed(target.spec)) if transposed else target.spec)
    if not transposed and regroup == 1 and jnp.dtype(stored) == jnp.dtype(dtype):
        return _Placing(source, None, target)
    return _Placing(source, _relayout(jnp.dtype(dtype), transposed, regroup, cfg.num_kv_heads, cfg.head_dim, target),
                    target)


def fuse_param(path: Sequence[Any], parts: Sequence[jax.Array], cfg: ModelConfig, mesh: Mesh | None) -> jax.Array:
    """The fused parameter at `path` built on the device from its parts (FUSED_PARTS order) as
    `place_param` placed them, with its sharding on `mesh`; `cfg` is the checkpoint's."""
    return _call(_fusion(path, cfg, mesh), *parts)


def _fusion(path: Sequence[Any], cfg: ModelConfig, mesh: Mesh | None) -> Any:
    return _fuse(str(path[-2]), cfg.num_kv_heads, cfg.head_dim, *_copies_and_sharding(path, cfg, mesh))


def _copies_and_sharding(path: Sequence[Any], cfg: ModelConfig, mesh: Mesh | None) -> tuple[int, NamedSharding | None]:
    """(KV-head copies of the parameter at `path`, its sharding on `mesh`; None without one)."""
    copies = kv_copies(cfg, tensor_parallel_size(mesh)) if is_qkv(path) else 1
    return copies, None if mesh is None else param_sharding(mesh, path)


def load_programs(tensors: Iterable[tuple[Sequence[Any], tuple[int, ...], Any, bool, str | None]], cfg: ModelConfig,
                  mesh: Mesh | None, dtype: Any) -> list[tuple[Any, tuple[jax.ShapeDtypeStruct, ...]]]:
    """The programs placing `tensors` runs (`place_param`, `fuse_param`), each once with the inputs
    it will be called on, in the order of first use. tensors: (path, stored shape, stored dtype,
    transposed, part) of each, in the order they are placed."""
    programs: dict[tuple, tuple[Any, tuple[jax.ShapeDtypeStruct, ...]]] = {}
    parts: dict[tuple, dict[str, jax.ShapeDtypeStruct]] = {}

    def add(program: Any, inputs: tuple[jax.ShapeDtypeStruct, ...]) -> None:
        programs.setdefault(_signature(program, inputs), (program, inputs))

    for path, shape, stored, transposed, part in tensors:
        plan = _placing(path, stored, cfg, mesh, dtype, transposed, part)
        placed = jax.ShapeDtypeStruct(shape, stored, sharding=plan.source)
        if plan.program is not None:
            add(plan.program, (placed,))
            # shape: a part (the only placed tensor the fusion reads) is never regrouped
            placed = jax.ShapeDtypeStruct(shape[::-1] if transposed else shape, jnp.dtype(dtype), sharding=plan.target)
        if part is not None:
            held = parts.setdefault(tuple(path), {})
            held[part] = placed
            names = FUSED_PARTS[str(path[-2])]
            if len(held) == len(names):
                del parts[tuple(path)]
                add(_fusion(path, cfg, mesh), tuple(held[n] for n in names))
    return list(programs.values())


@contextlib.contextmanager
def compiling_ahead(programs: Iterable[tuple[Any, tuple[jax.ShapeDtypeStruct, ...]]]) -> Iterator[None]:
    """Compile `programs` ((jitted function, abstract inputs), e.g. `load_programs`') on a thread of
    their own while the block runs. They are taken one by one on that thread, so the work of a
    generator is done there too. A first call in the block finds its program compiled, or waits for
    it to be (`_call`), and none is compiled twice. Loading reads the files meanwhile: tracing and
    lowering a program is host work of about 0.1 s even when the compilation cache holds it, 7
    programs were 0.9 s of an 8B load of 3.1 s on an H100, and a thread placing tensors waited on
    each. The block's end waits for the thread; an error in the block stops it after the program in
    hand. What fails here is left to its first call (which raises any real error)."""
    stop = threading.Event()

    def run() -> None:
        try:
            for program, inputs in programs:
                signature = _signature(program, inputs)
                with _compiling:
                    if stop.is_set():
                        return
                    if signature not in _compiled:
                        program.lower(*inputs).compile()
                        _compiled.add(signature)
        except Exception:  # noqa: BLE001 - the rest compiles at its first call
            return

    thread = threading.Thread(target=run, name="compile-ahead", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join()


def _signature(program: Any, inputs: Any) -> tuple:
    """What a program's compilation depends on: its inputs' (a pytree of arrays or abstract arrays)
    shapes, dtypes and, for committed inputs, shardings (an uncommitted array and an abstract input
    without one compile alike)."""
    committed = lambda a: a.committed if isinstance(a, jax.Array) else a.sharding is not None
    return (program, *((a.shape, jnp.dtype(a.dtype), a.sharding if committed(a) else None)
                       for a in jax.tree.leaves(inputs)))


def _call(program: Any, *arrays: jax.Array) -> jax.Array:
    """`program(*arrays)`, the first call per input signature under a lock: it compiles, loading
    places tensors on several threads, and jax does not share a compile in flight (concurrent first
    calls of one program each compiled it). A program compiled ahead (`compiling_ahead`) is found
    in jax's caches by its first call, which then only runs it."""
    signature = _signature(program, arrays)
    if signature not in _compiled:
        with _compiling:
            if signature not in _compiled:
                out = program(*arrays)
                _compiled.add(signature)
                return out
    return program(*arrays)


_compiling = threading.Lock()
_compiled: set = set()  # _signature of each program called (or compiled ahead) once


@functools.cache
def _relayout(dtype: Any, transposed: bool, copies: int, kv_heads: int, head_dim: int,
              sharding: NamedSharding | None) -> Any:
    """The device's part of loading one kind of tensor, compiled once per kind (not per layer);
    copies > 1: a whole qkv leaf laid out for none, re-laid out with each KV head `copies` times."""
    def run(x):
        x = (x.T if transposed else x).astype(dtype)
        if copies == 1:
            return x
        x = fuse_qkv(*split_qkv(x, kv_heads, head_dim), kv_heads, head_dim, copies)
        # Regrouped whole on every device (x is whole there), each then keeps its own columns: left
        # to itself, the partitioner split the regrouping and moved slices between devices.
        return x if sharding is None else jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, P()))
    return jax.jit(run, out_shardings=sharding)


@functools.cache
def _fuse(module: str, kv_heads: int, head_dim: int, copies: int, sharding: NamedSharding | None) -> Any:
    """The device's fusion of one kind of fused parameter, compiled once per kind (not per layer)."""
    return jax.jit(lambda *parts: fuse_parts(module, parts, kv_heads, head_dim, copies), out_shardings=sharding)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, RULES.spec(KV_AXES))


def place_kv(tree: Any, mesh: Mesh | None) -> Any:
    """A pool's or an affix cache's per-layer K/V arrays split by KV head over the mesh."""
    if mesh is None:
        return tree
    return jax.tree.map(lambda a: jax.device_put(a, kv_sharding(mesh)) if a.ndim == 3 else a, tree)


def place_rows(tree: Any, mesh: Mesh | None) -> Any:
    """Arrays whose leading axis is a batch of rows, split over `data` where the rows divide evenly
    (a batch of fewer rows than data shards runs replicated); other arrays replicated."""
    if mesh is None:
        return tree
    dp = mesh.shape["data"]

    def put(a):
        split = a.ndim > 0 and a.shape[0] % dp == 0
        return jax.device_put(a, NamedSharding(mesh, RULES.spec(ROWS_AXES) if split else P()))

    return jax.tree.map(put, tree)


def constrain_kv(a: jax.Array) -> jax.Array:
    """Inside a traced function under `use_mesh`: keep per-layer K/V [rows, kv_heads, head_dim]
    split by KV head (the partitioner is then never tempted to gather a pool); no-op without a mesh."""
    if model_axis_size() == 1:
        return a
    return jax.lax.with_sharding_constraint(a, RULES.spec(KV_AXES))


def model_axis_size() -> int:
    """The `model` axis size of the mesh being traced under (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "model" not in mesh.axis_names else mesh.shape["model"]


def rows_axis(rows: int) -> str | None:
    """The mesh axis a leading axis of `rows` rows is split over under the traced mesh: `data`
    where the rows divide evenly, else none (replicated)."""
    mesh = jax.sharding.get_abstract_mesh()
    return RULES.batch if not mesh.empty and rows % mesh.shape["data"] == 0 else None


def use_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """The mesh as the context of tracing and running (what shard_map and the KV constraints read);
    nothing without one."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def initialize_distributed() -> None:
    """jax.distributed.initialize for several hosts, from JAX_COORDINATOR_ADDRESS (host:port of
    process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID, or what jax detects itself (SLURM, Open MPI)."""
    env = {name: os.environ.get(var) for name, var in (("coordinator_address", "JAX_COORDINATOR_ADDRESS"),
                                                        ("num_processes", "JAX_NUM_PROCESSES"),
                                                        ("process_id", "JAX_PROCESS_ID"))}
    try:
        kwargs = {k: (int(v) if k != "coordinator_address" else v) for k, v in env.items() if v}
    except ValueError:
        raise InputError(f"JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers, got {env}") from None
    jax.distributed.initialize(**kwargs)


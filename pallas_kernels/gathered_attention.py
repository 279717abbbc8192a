"""Bidirectional attention whose keys/values are gathered from a KV pool through a read-slot map.

Requests share pool rows (an affix's KV is stored once) by pointing their slot maps at the same
slots; nothing is copied. Keys are stored already rotated (RoPE) at the position they were computed
at; a span read at another offset is read with the query rotated by that offset instead, by the
caller, so the kernel never rotates a key.

Two backends with one signature: "xla" (plain jnp, the oracle and the CPU path) and "pallas"
(Triton lowering: online softmax over key tiles; the query heads of one kv head are stacked on the
matmul M dimension so MHA and GQA both feed the tensor cores; long key ranges are split across
programs and merged, so small batches still fill the GPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Finite stand-in for -inf (no NaN from inf - inf in the online softmax).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
BACKENDS = ("xla", "pallas")
# Programs to aim for when choosing the key-range split: a couple per streaming multiprocessor.
_TARGET_PROGRAMS = 264
# (block_q, block_k, num_warps, num_stages) per regime: the fastest of the H200 tuning
# (docs/BENCHMARKS.md). "decode": at most one query block of rows per kv head (an in-block step);
# "recompute": more.
_TUNED = {"decode": (128, 128, 8, 2), "recompute": (64, 64, 4, 3)}  # eval.bench_attention, H200, 2026-12-01


def rope_inv_freq(head_dim: int, theta: float) -> jax.Array:
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE; x: [B, T, H, D], positions: [B, T]. Computed in fp32, returned in x's dtype."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(x.shape[-1], theta)
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def gathered_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    read_slot_map: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float | None = None,
    backend: str = "pallas",
    interpret: bool | None = None,
    return_lse: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """softmax(q k^T * sm_scale) v with key n of row b read from pool row read_slot_map[b, n].

    q: [B, Tq, Hq, D] (rotated as the keys it reads were); k_pool, v_pool: [S, Hkv, D], Hq a
    multiple of Hkv (query head h reads kv head h // (Hq // Hkv)); read_slot_map: int32 [B, Tk];
    kv_lens: int32 [B], keys n >= kv_lens[b] are ignored, whatever their slot entries hold (a row
    with kv_lens 0 gives 0). Returns [B, Tq, Hq, D] in q's dtype (fp32 accumulation); with
    return_lse also the log-sum-exp of the scaled scores, fp32 [B, Tq, Hq] (MASK_VALUE where
    kv_lens is 0), to merge partial results.
    interpret: run the Pallas kernel on CPU (default: whenever the default backend is not a GPU).
    The block and split arguments tune the Pallas kernel only; unset block_q / block_k / num_warps /
    num_stages take the fastest H200 configuration of docs/BENCHMARKS.md for the regime (decode or
    recompute, by the query rows per kv head); unset splits divide the key range so that small
    batches still fill the GPU.
    """
    b, tq, hq, d = q.shape
    s, hkv, dk = k_pool.shape
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ")
    if dk != d or hq % hkv:
        raise ValueError(f"q {q.shape} does not fit a pool of {hkv} kv heads of dim {dk}")
    if read_slot_map.ndim != 2 or read_slot_map.shape[0] != b or kv_lens.shape != (b,):
        raise ValueError(f"read_slot_map {read_slot_map.shape} / kv_lens {kv_lens.shape} do not match batch {b}")
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    read_slot_map, kv_lens = read_slot_map.astype(jnp.int32), kv_lens.astype(jnp.int32)
    if backend == "xla":
        out, lse = _reference(q, k_pool, v_pool, read_slot_map, kv_lens, sm_scale)
    elif backend == "pallas":
        interpret = _interpret(interpret, d)
        regime = "decode" if tq * _pow2_at_least(hq // hkv, 1) <= _TUNED["decode"][0] else "recompute"
        block_q, block_k, num_warps, num_stages = (_TUNED[regime][i] if x is None else x
                                                   for i, x in enumerate((block_q, block_k, num_warps, num_stages)))
        out, lse = _pallas(q, k_pool, v_pool, read_slot_map, kv_lens, sm_scale, interpret, block_q, block_k,
                           num_warps, num_stages, splits)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    return (out, lse) if return_lse else out


def _interpret(interpret: bool | None, head_dim: int) -> bool:
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if not interpret and not supported_on_gpu(head_dim):
        raise ValueError(f"the compiled kernel needs a power-of-two head dim >= 32, got {head_dim}; "
                         "use backend='xla' or interpret=True")
    return interpret


def merge_partials(outs: list[jax.Array], lses: list[jax.Array]) -> jax.Array:
    """Attention over the union of disjoint key sets from each set's output and log-sum-exp. One
    set's output is returned as it is: the merge would weigh it by exp(0) = 1 and divide by 1."""
    if len(outs) == 1:
        return outs[0]
    m = functools.reduce(jnp.maximum, lses)
    weights = [jnp.exp(lse - m)[..., None] for lse in lses]
    total = sum(w * o.astype(jnp.float32) for w, o in zip(weights, outs))
    norm = sum(weights)
    return jnp.where(norm > 0, total / jnp.where(norm > 0, norm, 1.0), 0.0).astype(outs[0].dtype)


def _reference_scores(q, k_pool, slots, kv_lens, sm_scale):
    """Plain jnp: gather the keys and score them. Returns (scores [B, Tq, Hkv, G, Tk] fp32 with
    -inf beyond kv_lens, in-range slots [B, Tk], the in-range mask [B, Tk])."""
    b, tq, hq, d = q.shape
    hkv = k_pool.shape[1]
    valid = jnp.arange(slots.shape[1])[None] < kv_lens[:, None]
    slots = jnp.where(valid, slots, 0)
    k = k_pool[slots]  # [B, Tk, Hkv, D]
    qg = q.reshape(b, tq, hkv, hq // hkv, d)
    scores = jnp.einsum("bqhgd,bkhd->bqhgk", qg, k, preferred_element_type=jnp.float32) * sm_scale
    return jnp.where(valid[:, None, None, None, :], scores, -jnp.inf), slots, valid


def _reference(q, k_pool, v_pool, slots, kv_lens, sm_scale):
    """The oracle: gather, masked softmax, all in plain jnp."""
    b, tq, hq, d = q.shape
    scores, slots, _ = _reference_scores(q, k_pool, slots, kv_lens, sm_scale)
    v = v_pool[slots]
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = jnp.where(l > 0, out / jnp.where(l > 0, l, 1.0), 0.0)
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), MASK_VALUE)
    return out.reshape(b, tq, hq, d).astype(q.dtype), lse.reshape(b, tq, hq)


def _pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _dot(a, b):
    """fp32 accumulation; fp32 operands at full precision (not tf32), so fp32 matches the oracle."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def supported_on_gpu(head_dim: int) -> bool:
    """Compiled (not interpreted) kernels need a power-of-two head dim of at least 32 (matmul dims >= 16)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def _scores(q, k, inside, sm_scale):
    """Scaled scores [bm, block_k] fp32 of a query block against a key tile; MASK_VALUE outside."""
    return jnp.where(inside[None, :], _dot(q, k.T) * sm_scale, MASK_VALUE)


def _attention_kernel(lens_ref, slots_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *,
                      block_k: int, tiles_per_split: int, sm_scale: float):
    """One (row, kv head, query block, key split): online softmax over its key tiles.

    The next tile's slots are loaded one iteration ahead, so gathering K/V never waits on the slot map.
    """
    b, split = pl.program_id(0), pl.program_id(3)
    kv_len = lens_ref[b]
    bm, d = q_ref.shape
    q = q_ref[...]
    n_tiles = slots_ref.shape[0] // block_k
    first = split * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, pl.cdiv(kv_len, block_k))
    load_slots = lambda tile: slots_ref[pl.ds(jnp.minimum(tile, n_tiles - 1) * block_k, block_k)]

    def body(tile, carry):
        acc, m_prev, l_prev, raw_slots = carry
        next_slots = load_slots(tile + 1)
        start = tile * block_k
        inside = start + jnp.arange(block_k) < kv_len
        slots = jnp.where(inside, raw_slots, 0)
        k, v = k_ref[slots], v_ref[slots]
        scores = _scores(q, k, inside, sm_scale)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(scores - m_next[:, None])
        acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_next, l_prev * correction + p.sum(axis=-1), next_slots

    init = (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), MASK_VALUE, jnp.float32), jnp.zeros((bm,), jnp.float32),
            load_slots(first))
    acc, m, l, _ = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    m_ref[...] = m
    l_ref[...] = l


def _importance_kernel(lens_ref, slots_ref, q_ref, lse_ref, w_ref, k_ref, out_ref, *,
                       block_q: int, block_k: int, sm_scale: float):
    """One (row, kv head, key tile): sum over weighted query rows of softmax probabilities."""
    b, tile = pl.program_id(0), pl.program_id(2)
    start = tile * block_k
    inside = start + jnp.arange(block_k) < lens_ref[b]
    slots = jnp.where(inside, slots_ref[pl.ds(start, block_k)], 0)
    k = k_ref[slots]

    def body(qb, acc):
        rows = pl.ds(qb * block_q, block_q)
        scores = _scores(q_ref[rows, :], k, inside, sm_scale)
        p = jnp.where(inside[None, :], jnp.exp(scores - lse_ref[rows][:, None]), 0.0) * w_ref[rows][:, None]
        return acc + p.sum(axis=0)

    out_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // block_q, body, jnp.zeros((block_k,), jnp.float32))


def _stack_heads(x, hkv, block_q, pad_value=0.0):
    """[B, Tq, Hq, ...] -> [B, Hkv, rows_p, ...]: the query heads of one kv head stacked as matmul rows
    (row t * group_p + g, the group padded to a power of two, rows to a multiple of the block).

    Returns the stacked array, the query block size and the inverse for outputs shaped like it.
    """
    b, tq, hq = x.shape[:3]
    group = hq // hkv
    group_p = 1 << (group - 1).bit_length()
    rows = tq * group_p
    bm = min(block_q, _pow2_at_least(rows))
    rows_p = pl.cdiv(rows, bm) * bm
    tail = x.shape[3:]
    xs = jnp.moveaxis(x.reshape(b, tq, hkv, group, *tail), 1, 2)
    xs = jnp.pad(xs, [(0, 0)] * 3 + [(0, group_p - group)] + [(0, 0)] * len(tail), constant_values=pad_value)
    xs = jnp.pad(xs.reshape(b, hkv, rows, *tail), [(0, 0), (0, 0), (0, rows_p - rows)] + [(0, 0)] * len(tail),
                 constant_values=pad_value)

    def unstack(a):
        a = a[:, :, :rows].reshape(b, hkv, tq, group_p, *a.shape[3:])[:, :, :, :group]
        return jnp.moveaxis(a, 2, 1).reshape(b, tq, hq, *a.shape[4:])

    return xs, bm, unstack


def _key_tiles(slots, block_k):
    """Slot map padded to whole key tiles: (slots, key tile, tile count)."""
    b, tk = slots.shape
    bk = min(block_k, _pow2_at_least(tk))
    n_tiles = pl.cdiv(tk, bk)
    return jnp.pad(slots, ((0, 0), (0, n_tiles * bk - tk))), bk, n_tiles


def _common_specs(b, tk_p, head_dim, pool_rows):
    """BlockSpecs of (kv_lens, slots) and of one kv head's pool; grid (b, h, ...)."""
    keys = [pl.BlockSpec((b,), lambda *_: (0,)), pl.BlockSpec((None, tk_p), lambda bi, h, *_: (bi, 0))]
    return keys, pl.BlockSpec((pool_rows, None, head_dim), lambda bi, h, *_: (0, h, 0))


def _compiler_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 (GPU module, imported on use)

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# The kernels' wrappers are jitted so that calls of the same shapes inside one program (a model's layers,
# unrolled) are lowered once: lowering a Pallas kernel to Triton is Python work, about 0.1 s a call, and a
# program is lowered at every start, even when its executable comes from the persistent compilation cache.
_TUNING = ("sm_scale", "interpret", "block_q", "block_k", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=(*_TUNING, "splits"))
def _pallas(q, k_pool, v_pool, slots, kv_lens, sm_scale, interpret, block_q, block_k, num_warps, num_stages,
            splits):
    b, tq, hq, d = q.shape
    s, hkv, _ = k_pool.shape
    qs, bm, unstack = _stack_heads(q, hkv, block_q)
    rows_p = qs.shape[2]
    slots, bk, n_tiles = _key_tiles(slots, block_k)
    n_q = rows_p // bm
    if splits is None:
        splits = max(1, min(n_tiles, math.ceil(_TARGET_PROGRAMS / (b * hkv * n_q))))
    tiles_per_split = pl.cdiv(n_tiles, splits)
    splits = pl.cdiv(n_tiles, tiles_per_split)

    key_specs, pool_spec = _common_specs(b, slots.shape[1], d, s)
    part = jax.ShapeDtypeStruct((splits, b, hkv, rows_p), jnp.float32)
    o, m, l = pl.pallas_call(
        functools.partial(_attention_kernel, block_k=bk, tiles_per_split=tiles_per_split, sm_scale=sm_scale),
        grid=(b, hkv, n_q, splits),
        in_specs=[*key_specs, pl.BlockSpec((None, None, bm, d), lambda bi, h, i, sp: (bi, h, i, 0)), pool_spec, pool_spec],
        out_specs=[
            pl.BlockSpec((None, None, None, bm, d), lambda bi, h, i, sp: (sp, bi, h, i, 0)),
            pl.BlockSpec((None, None, None, bm), lambda bi, h, i, sp: (sp, bi, h, i)),
            pl.BlockSpec((None, None, None, bm), lambda bi, h, i, sp: (sp, bi, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((splits, b, hkv, rows_p, d), jnp.float32), part, part],
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        # query blocks x rows per (row, kv head) in the name: a trace tells in-block steps from recomputes
        name=f"gathered_attention_{n_q}x{bm}",
    )(kv_lens, slots, qs, k_pool, v_pool)

    if splits == 1:
        out, m, l = o[0], m[0], l[0]
    else:  # merge the key splits
        m_all = m.max(axis=0)
        w = l * jnp.exp(m - m_all[None])
        l = w.sum(axis=0)
        out = (o * w[..., None]).sum(axis=0) / jnp.where(l > 0, l, 1.0)[..., None]
        m = m_all
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), MASK_VALUE)
    return unstack(out).astype(q.dtype), unstack(lse)


def anchor_importance(
    q: jax.Array,
    k_pool: jax.Array,
    read_slot_map: jax.Array,
    kv_lens: jax.Array,
    query_weights: jax.Array,
    *,
    sm_scale: float | None = None,
    backend: str = "pallas",
    interpret: bool | None = None,
    block_q: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    lse: jax.Array | None = None,
) -> jax.Array:
    """ACache's anchor-probe importance (eq. 4-5) of each gathered key, for one layer.

    For key n of row b: sum over query tokens t, weighted by query_weights[b, t] (1 for the mask
    tokens that count), and over all query heads, of softmax over the row's keys (those below
    kv_lens). Arguments as in `gathered_attention`. Returns fp32 [B, Tk], 0 beyond kv_lens.
    The Pallas path takes each query's log-sum-exp from the attention kernel (or `lse`, fp32
    [B, Tq, Hq], when the caller ran `gathered_attention(..., return_lse=True)` on the same keys),
    then sums the probabilities per key tile without materialising the [heads, queries, keys] matrix.
    """
    b, tq, hq, d = q.shape
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    read_slot_map, kv_lens = read_slot_map.astype(jnp.int32), kv_lens.astype(jnp.int32)
    weights = query_weights.astype(jnp.float32)
    if backend == "xla":
        scores, _, valid = _reference_scores(q, k_pool, read_slot_map, kv_lens, sm_scale)
        probs = jnp.where(valid[:, None, None, None, :], jax.nn.softmax(scores, axis=-1), 0.0)
        return jnp.einsum("bqhgk,bq->bk", probs, weights)
    if backend != "pallas":
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    interpret = _interpret(interpret, d)
    if lse is None:
        _, lse = _pallas(q, k_pool, k_pool, read_slot_map, kv_lens, sm_scale, interpret, block_q, block_k,
                         num_warps, num_stages, None)
    return _importance(q, k_pool, read_slot_map, kv_lens, weights, lse, sm_scale=sm_scale, interpret=interpret,
                       block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=_TUNING)
def _importance(q, k_pool, read_slot_map, kv_lens, weights, lse, sm_scale, interpret, block_q, block_k, num_warps,
                num_stages):
    """`anchor_importance`'s Pallas path."""
    b, tq, hq, d = q.shape
    s, hkv, _ = k_pool.shape
    qs, bm, _ = _stack_heads(q, hkv, block_q)
    lse_s, _, _ = _stack_heads(lse, hkv, block_q, pad_value=jnp.finfo(jnp.float32).max)
    w_s, _, _ = _stack_heads(jnp.broadcast_to(weights[:, :, None], (b, tq, hq)), hkv, block_q)
    tk = read_slot_map.shape[1]
    slots, bk, n_tiles = _key_tiles(read_slot_map, block_k)
    rows_p = qs.shape[2]
    key_specs, pool_spec = _common_specs(b, slots.shape[1], d, s)
    per_row = lambda bi, h, t: (bi, h, 0)
    out = pl.pallas_call(
        functools.partial(_importance_kernel, block_q=bm, block_k=bk, sm_scale=sm_scale),
        grid=(b, hkv, n_tiles),
        in_specs=[*key_specs, pl.BlockSpec((None, None, rows_p, d), lambda bi, h, t: (bi, h, 0, 0)),
                  pl.BlockSpec((None, None, rows_p), per_row), pl.BlockSpec((None, None, rows_p), per_row), pool_spec],
        out_specs=pl.BlockSpec((None, None, bk), lambda bi, h, t: (bi, h, t)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, n_tiles * bk), jnp.float32),
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="anchor_importance",
    )(kv_lens, slots, qs, lse_s, w_s, k_pool)
    return out.sum(axis=1)[:, :tk]

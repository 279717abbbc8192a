"""The bidirectional transformer of the LLaDA and Dream families, in Flax NNX.

One network serves both: pre-norm blocks with RMSNorm (fp32), RoPE (rotate-half), MHA or GQA with
optional q/k/v bias, a SwiGLU MLP and an untied LM head. Dream's logit shift is a property of the
config. The q, k and v projections are one weight, `attn.qkv`, and the MLP's gate and up another,
`mlp.gate_up`: one matmul each (their column layouts: acache_jax/network/sharding.py `fuse_qkv`,
`fuse_gate_up`); checkpoints keep them apart, and loading fuses them. Jitted code has one entry,
`Structure.forward(params, tokens, inputs)` over the weights as a flat list (`Model.flat`): the
tokens it is given, at the positions `inputs` says, attending either to their own rows (dense) or,
through a `PoolAccess`, to pool rows after writing their own K/V there (every cache policy, static
or served). `Model.forward` and `Model.logits` are its jitted form for callers outside jitted code;
training differentiates the module itself (eval/train.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from acache_jax.network.attention import attend_dense, attend_pool
from acache_jax.network.config import DecodeConfig, DecodeError, InputError, ModelConfig, name_defaults
from acache_jax.network.kv import KVPool, PoolAccess
from acache_jax.network.sharding import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv, use_mesh


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardInputs:
    """Everything a forward needs besides its tokens.

    Dense (access None): tokens [B, T] attend to their row's tokens where `valid`. With a pool
    (`access`): tokens [M] (any segments side by side) write their K/V at `access.write_slots`,
    then read their segment's rows (acache_jax/network/kv.py).
    """

    positions: jax.Array  # [B, T] or [M] int32
    valid: jax.Array | None = None  # dense: [B, T] bool, which tokens are keys (padding: False); default all
    access: PoolAccess | None = None
    logit_index: jax.Array | None = None  # token indices whose logits are wanted (dense: [B, Tl] along T; pool: any shape into M)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array | None  # [B, Tl, V] (dense) or [*logit_index.shape, V] (pool), float32
    # Per layer (a tuple, not a stacked array: stacking would copy every layer's K/V once more):
    k: tuple[jax.Array, ...]  # layers x [B, T | M, kv_heads, head_dim] keys of the computed tokens, before RoPE
    v: tuple[jax.Array, ...]  # layers x [B, T | M, kv_heads, head_dim]
    pool: KVPool | None = None  # the pool after this forward's writes
    probe: jax.Array | None = None  # [S, N] float32 anchor-probe importance of the probed read set's rows


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias, zeros at first); kernel is [in, out] (the transpose of PyTorch's layout)."""

    def __init__(self, kernel: jax.Array, bias: bool):
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(jnp.zeros(kernel.shape[-1:], kernel.dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        return y + self.bias[...] if self.bias is not None else y


def _random_kernel(d_in: int, d_out: int, dtype: Any, rngs: nnx.Rngs) -> jax.Array:
    return jax.random.normal(rngs.params(), (d_in, d_out), dtype) * d_in**-0.5


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        d, hd, kv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
        # Drawn as the three projections they fuse (the random values of separate ones), stored fused.
        q, k, v = (_random_kernel(d, n * hd, dtype, rngs) for n in (cfg.num_heads, kv, kv))
        self.qkv = Linear(fuse_qkv(q, k, v, kv, hd), cfg.qkv_bias)
        self.o = Linear(_random_kernel(cfg.num_heads * hd, d, dtype, rngs), False)
        self.cfg = cfg

    def __call__(self, x: jax.Array, inputs: ForwardInputs, backend: str | None):
        """(output, k, v, pool K and V of this layer or None, probe scores or None); `inputs.access`
        holds this layer's pool alone (`_layer_inputs`)."""
        cfg = self.cfg
        lead = x.shape[:-1]
        with jax.named_scope("qkv"):
            parts = split_qkv(self.qkv(x), cfg.num_kv_heads, cfg.head_dim)
            q, k, v = (y.reshape(*lead, -1, cfg.head_dim) for y in parts)
        with jax.named_scope("attention"):
            if inputs.access is None:
                valid = jnp.ones(lead, bool) if inputs.valid is None else inputs.valid
                out, pool_kv, scores = attend_dense(q, k, v, inputs.positions, valid, cfg.rope_theta, backend), None, None
            else:
                out, pool_k, pool_v, scores = attend_pool(q, k, v, inputs.positions, inputs.access,
                                                          cfg.rope_theta, backend)
                pool_kv = (pool_k, pool_v)
        return self.o(out.reshape(*lead, -1)), k, v, pool_kv, scores


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        gate, up = (_random_kernel(d, f, dtype, rngs) for _ in range(2))
        self.gate_up = Linear(fuse_gate_up(gate, up), False)
        self.down = Linear(_random_kernel(f, d, dtype, rngs), False)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = split_gate_up(self.gate_up(x))
        return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array, inputs: ForwardInputs, backend: str | None):
        h, k, v, pool_kv, scores = self.attn(self.attn_norm(x), inputs, backend)
        x = x + h
        with jax.named_scope("mlp"):
            return x + self.mlp(self.mlp_norm(x)), k, v, pool_kv, scores


class Transformer(nnx.Module):
    """Random-initialised network; `acache_jax.load` fills it with checkpoint weights."""

    def __init__(self, cfg: ModelConfig, dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(_random_kernel(cfg.hidden_size, cfg.vocab_size, dtype, rngs), False)

    def __call__(self, token_ids: jax.Array, inputs: ForwardInputs, *, with_logits: bool = True,
                 attn_backend: str | None = None, embeddings: jax.Array | None = None) -> ForwardOutput:
        """Forward over the given tokens ([B, T] dense, [M] with a pool; see `ForwardInputs`).

        Dream's shift is along the tokens of this call: logits at token j come from token j-1 of the
        same row or segment (the first keeps its own), exactly as upstream shifts the logits of
        whatever it computed.
        attn_backend: "xla" (plain jnp, any device), "pallas" (the gathered-attention kernel; interpreted
            off GPU) or "cudnn" (fused GPU kernel, bf16); default: pallas on a GPU, else xla.
        embeddings: the tokens' input vectors [*token_ids.shape, D], used instead of the embedding
        table's rows (made from the table by the caller: training's one-hot matmul, eval/train.py).
        """
        x = jnp.take(self.embed[...], token_ids, axis=0) if embeddings is None else embeddings
        ks, vs, pool_k, pool_v = [], [], [], []
        importance = None
        # A Python loop, unrolled under jit: a scan over stacked layers copies each layer's
        # weights through dynamic slices, which doubles the latency of small decode forwards.
        for layer, block in enumerate(self.layers):
            x, k, v, pool_kv, scores = _call_block(block, x, _layer_inputs(inputs, layer), attn_backend)
            ks.append(k)
            vs.append(v)
            if pool_kv is not None:
                pool_k.append(pool_kv[0])
                pool_v.append(pool_kv[1])
            if scores is not None:
                importance = scores if importance is None else importance + scores
        pool = KVPool(tuple(pool_k), tuple(pool_v)) if inputs.access is not None else None
        logits = None
        if with_logits:
            with jax.named_scope("lm_head"):
                h = self.final_norm(self._logit_rows(x, inputs))
                logits = jnp.dot(h, self.lm_head.kernel[...], preferred_element_type=jnp.float32)
        return ForwardOutput(logits, tuple(ks), tuple(vs), pool, importance)

    def _logit_rows(self, x: jax.Array, inputs: ForwardInputs) -> jax.Array:
        """The hidden states the logits come from (Dream: each from the token before it)."""
        idx = inputs.logit_index
        if inputs.access is None:  # dense: along T
            if self.cfg.logit_shift:
                if idx is None:
                    idx = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
                idx = jnp.maximum(idx - 1, 0)
            return x if idx is None else jnp.take_along_axis(x, idx[..., None], axis=1)
        if idx is None:
            idx = jnp.arange(x.shape[0])
        if self.cfg.logit_shift:  # the previous token if it belongs to the same segment
            segment = inputs.access.segment
            before = jnp.maximum(idx - 1, 0)
            idx = jnp.where((idx > 0) & (segment[before] == segment[idx]), before, idx)
        return x[idx]


def _layer_inputs(inputs: ForwardInputs, layer: int) -> ForwardInputs:
    """`inputs` with the pool narrowed to layer `layer` alone: a block sees only its own layer's pool."""
    if inputs.access is None:
        return inputs
    pool = inputs.access.pool
    narrowed = KVPool((pool.k[layer],), (pool.v[layer],))
    return dataclasses.replace(inputs, access=dataclasses.replace(inputs.access, pool=narrowed))


def _call_block(block: Block, x: jax.Array, inputs: ForwardInputs, backend: str | None) -> tuple:
    """`block(x, inputs, backend)` as a nested jitted call, so that a program traces and lowers
    the layers' one shape once instead of once per layer: tracing and lowering are Python work, paid
    at every start, cached executable or not (XLA inlines the calls, so the compiled program is the
    same)."""
    graphdef, state = nnx.split(block)
    return _block_forward(graphdef, state, x, inputs, backend)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _block_forward(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, inputs: ForwardInputs,
                   backend: str | None) -> tuple:
    return nnx.merge(graphdef, state)(x, inputs, backend)


def abstract_transformer(cfg: ModelConfig, dtype: Any) -> Transformer:
    """The network's structure with shape-only leaves (no memory), to be filled from a checkpoint."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(0)))


@dataclasses.dataclass(frozen=True, eq=False)
class Structure:
    """A model's structure as a static argument of jitted code, hashed by identity (hashing a
    graphdef walks the module tree), with the parameters passed as a flat list of arrays
    (flattening an nnx.State runs Python per variable): together milliseconds per call for a
    32-layer model. Every leaf has the model's dtype."""

    graphdef: nnx.GraphDef
    treedef: Any  # the parameters' treedef
    config: ModelConfig

    def forward(self, params: list[jax.Array], tokens: jax.Array, inputs: ForwardInputs, *, with_logits: bool = True,
                attn_backend: str | None = None) -> ForwardOutput:
        """The network over `params` (`Model.flat`'s leaves), inside jitted code: see
        `Transformer.__call__`."""
        network = nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))
        return network(tokens, inputs, with_logits=with_logits, attn_backend=attn_backend)


@functools.cache
def structure(graphdef: nnx.GraphDef, treedef: Any, config: ModelConfig) -> Structure:
    """One Structure per distinct model structure, so that every model and engine over it reuses
    the compiled programs."""
    return Structure(graphdef, treedef, config)


def check_text(text: Any, what: str = "text") -> str:
    """`text` if it is a string the tokenizer can take, else an InputError naming `what`. A Python
    string may hold lone surrogates (a JSON escape such as "\\ud800" without its pair, or the bytes of
    a command-line argument that are not UTF-8, which Python keeps as U+DC80-U+DCFF): they are not
    Unicode text, and the tokenizer would fail on them with a TypeError that names nothing."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid Unicode text: character {e.start} is the lone surrogate "
                         f"{ascii(text[e.start])[1:-1]} (bytes that are not UTF-8, or a \\uXXXX escape "
                         "without its pair)") from None
    return text


# Generated text ends at the first of these: the end-of-turn tokens of the families' chat templates,
# and DiffuCoder-Instruct's pad token, which fills the generation after its answer.
CHAT_END_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<|dlm_pad|>")


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: config, network structure, weights, (if shipped) tokenizer, and its
    generation defaults (generation_config.json) with the ids generated text ends at."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Any = None
    generation_config: DecodeConfig = DecodeConfig()
    eos_token_ids: tuple[int, ...] = ()  # from generation_config.json; config.json's eos always counts
    mesh: Mesh | None = None  # the (data, model) mesh the weights are split over (acache_jax/network/sharding.py)
    generation_config_file: Path | None = None  # where generation_config came from (named in errors)

    @classmethod
    def from_module(cls, module: Transformer, tokenizer: Any = None,
                    generation_config: DecodeConfig = DecodeConfig()) -> Model:
        graphdef, params = nnx.split(module)
        return cls(module.cfg, graphdef, params, tokenizer, generation_config)

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """The model's generation defaults with some fields changed, e.g. `decode_config(cache="acache")`.
        An error caused by a default the caller did not change says where that default came from."""
        try:
            return self.generation_config.replace(**overrides)
        except DecodeError as e:
            raise DecodeError(self.name_defaults(str(e), overrides)) from None

    def name_defaults(self, message: str, given: Iterable[str]) -> str:
        """`message` with a note naming each generation setting it mentions that is not in `given`:
        the model's default, from its generation_config.json (`config.name_defaults`)."""
        return name_defaults(message, self.generation_config, self.generation_config_file, given)

    @functools.cached_property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids generated text ends at: config eos, generation_config eos ids, chat end-of-turn tokens."""
        stops = {self.config.eos_token_id, *self.eos_token_ids}
        if self.tokenizer is not None:
            vocab = self.tokenizer.get_vocab()
            stops |= {vocab[t] for t in CHAT_END_TOKENS if t in vocab}
        return frozenset(stops)

    def encode(self, text: str, *, chat: bool = True, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`: a user turn of the tokenizer's chat template (with `chat`, when it has
        one), else the text with the tokenizer's special tokens (BOS) or, with special_tokens=False,
        a plain span that joins exactly with others (affixes, prompt tails)."""
        if self.tokenizer is None:
            raise InputError("this model ships no tokenizer: give token ids")
        check_text(text)
        if chat and special_tokens and getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        return list(self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    def answer_ids(self, tokens: Any) -> list[int]:
        """Generated ids up to the first stop id, masks left out."""
        ids = [int(t) for t in tokens]
        end = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), len(ids))
        return [t for t in ids[:end] if t != self.config.mask_token_id]

    def answer_text(self, tokens: Any) -> str | None:
        """The generated text up to the first stop id (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(self.answer_ids(tokens), skip_special_tokens=True)

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies config and weights (a digest of a few weight sums): caches built from this model
        carry it, so that a cache is never used with another model."""
        leaves = self.flat[1]
        sums = jax.device_get([jnp.sum(leaf.astype(jnp.float32)) for leaf in (leaves[0], leaves[len(leaves) // 2], leaves[-1])])
        return hashlib.sha256(repr((self.config, [float(x) for x in sums])).encode()).hexdigest()[:16]

    @functools.cached_property
    def flat(self) -> tuple[Structure, list[jax.Array]]:
        """(structure, parameter leaves): what jitted code takes instead of graphdef and params."""
        leaves, treedef = jax.tree.flatten(self.params)
        return structure(self.graphdef, treedef, self.config), leaves

    @property
    def dtype(self) -> jnp.dtype:
        return self.params["embed"][...].dtype

    def forward(self, token_ids: jax.Array, inputs: ForwardInputs, **kwargs: Any) -> ForwardOutput:
        """`Structure.forward` with this model's weights, jitted (static keywords: with_logits, attn_backend)."""
        with use_mesh(self.mesh):
            return _jit_forward(*self.flat, token_ids, inputs, **kwargs)

    def logits(self, token_ids: jax.Array) -> jax.Array:
        """Logits [B, T, V] float32 predicting every position of `token_ids` [B, T] under full
        bidirectional attention at positions 0..T-1 (for Dream, after the shift)."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
            raise InputError(f"token_ids must be integer token ids shaped [B, T], got {ids.dtype}{list(ids.shape)}")
        bad = ids[(ids < 0) | (ids >= self.config.vocab_size)]
        if bad.size:
            raise InputError(f"token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5].tolist()}")
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return self.forward(jnp.asarray(ids, jnp.int32), ForwardInputs(positions)).logits


_jit_forward = jax.jit(Structure.forward, static_argnums=0, static_argnames=("with_logits", "attn_backend"))

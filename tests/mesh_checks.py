"""Checks on a mesh of forced host devices, run by tests/test_sharding.py in a subprocess:
`python tests/mesh_checks.py GROUP WORKDIR` (XLA_FLAGS must force 8 devices before jax is imported,
which the pytest process, with jax imported and one device, cannot do). Each failed check raises.
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import acache_jax  # noqa: E402
from acache_jax import Engine  # noqa: E402
from acache_jax.decoding.decode import generate  # noqa: E402
from acache_jax.decoding.layout import Request  # noqa: E402
from acache_jax.network.config import DecodeConfig, ModelConfig  # noqa: E402
from acache_jax.network.sharding import MeshError, check_mesh, make_mesh, param_axes, split_qkv  # noqa: E402
from tests import hf_checkpoints  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "decode"
AFFIX = list(range(30, 53))
REQUESTS = [
    Request([5, 17, 33, 2, 90], affix_position="prefix", seed=1),
    Request([11, 3, 3, 64, 8, 1, 2], tail=[7, 8, 9], affix_position="infix", seed=2),
    Request([23, 99, 54], affix_position="suffix", seed=3),
]


def dream_gqa(workdir: Path) -> Path:
    """A tiny Dream with 8 query heads on 2 KV heads: split by KV head at tp 2, KV heads copied at tp 4."""
    cfg = hf_checkpoints.dream_config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    return hf_checkpoints.write_checkpoint(workdir / "dream-gqa", cfg, hf_checkpoints.random_weights(cfg, seed=3))


def model_dirs(workdir: Path) -> dict[str, Path]:
    return {"llada": FIXTURES / "llada", "dream": dream_gqa(workdir)}


def split_axis(path) -> int | None:
    axes = param_axes(path)
    return next((i for i, a in enumerate(axes) if a in ("heads", "kv_heads", "mlp", "vocab")), None)


def check_sharded(model: acache_jax.Model, tp: int) -> None:
    """Every split parameter holds 1/tp of its split axis on each device; the rest is whole."""
    for path, leaf in nnx_leaves(model):
        axis = split_axis(path)
        assert isinstance(leaf.sharding, NamedSharding), (path, leaf.sharding)
        for shard in leaf.addressable_shards:
            expected = list(leaf.shape)
            if axis is not None:
                expected[axis] //= tp
            assert list(shard.data.shape) == expected, (path, shard.data.shape, expected)


def nnx_leaves(model):
    from flax import nnx

    flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(model.params))
    return [(tuple(k.key for k in path), leaf) for path, leaf in flat]


def foreseen_and_called(set_attr=setattr) -> tuple[list, set]:
    """Record, from here on, the signatures a snapshot load compiles ahead (its finiteness check
    included) and those its placing programs are called with (here on meshes; test_convert without
    one). set_attr: how to patch (pytest's `monkeypatch.setattr` undoes it after the test)."""
    from acache_jax.network import checkpoint, sharding
    foreseen, called = [], set()
    ahead, call = checkpoint.compiling_ahead, sharding._call

    def recording_ahead(programs):
        programs = list(programs)
        foreseen.extend(sharding._signature(p, inputs) for p, inputs in programs)
        return ahead(programs)

    def recording_call(program, *arrays):
        called.add(sharding._signature(program, arrays))
        return call(program, *arrays)

    set_attr(checkpoint, "compiling_ahead", recording_ahead)
    set_attr(sharding, "_call", recording_call)
    return foreseen, called


def check_loading(workdir: Path) -> None:
    """Loading on a mesh: split leaves, no whole split tensor on one device at any point of the read;
    the programs compiled ahead are those the placing then calls."""
    from acache_jax.network import checkpoint
    dirs = model_dirs(workdir)
    foreseen, called = foreseen_and_called()

    def placing_compiled_ahead() -> None:  # the finiteness check is not called through sharding._call
        placing = [s for s in foreseen if s[0] is not checkpoint._all_finite]
        assert len(placing) == len(set(placing)) and set(placing) == called, (len(placing), len(called))
    watched = []
    reading = checkpoint.progress

    def watching(desc):
        def wrap(items):
            for item in reading(desc)(items):
                watched.append([a.shape for a in jax.live_arrays() if len(a.sharding.device_set) == 1 and a.size > 64])
                yield item
        return wrap

    checkpoint.progress = watching
    try:
        model = acache_jax.load(dirs["llada"], dtype="float32", mesh=make_mesh(4, 2))
    finally:
        checkpoint.progress = reading
    assert len(watched) > 10 and not any(watched), [w for w in watched if w][:3]
    placing_compiled_ahead()
    check_sharded(model, 4)
    bytes_per_device = {}
    for _, leaf in nnx_leaves(model):
        for shard in leaf.addressable_shards:
            bytes_per_device[shard.device] = bytes_per_device.get(shard.device, 0) + shard.data.nbytes
    total = sum(leaf.nbytes for _, leaf in nnx_leaves(model))
    assert len(bytes_per_device) == 8 and max(bytes_per_device.values()) < 0.3 * total, (bytes_per_device, total)
    # Dream-GQA at tp 4: 2 KV heads stored twice, each device one group of the fused qkv (2 query
    # heads, then a copy of their KV head's k and v); a converted checkpoint (stored without copies) too.
    from convert import convert

    converted = convert(dirs["dream"], workdir / "dream-gqa-converted", dtype="float32")
    ids = np.array([[5, 17, 33, 2, 90, 11, 3], [64, 8, 1, 2, 23, 99, 54]], np.int32)
    for src in (dirs["dream"], converted):
        foreseen.clear()
        called.clear()
        dream = acache_jax.load(src, dtype="float32", mesh=make_mesh(4))
        if src == dirs["dream"]:  # a snapshot, KV heads copied on the mesh
            placing_compiled_ahead()
        assert dream.config.num_kv_heads == 4, dream.config
        check_sharded(dream, 4)
        single = acache_jax.load(src, dtype="float32")
        for leaf in ("kernel", "bias"):
            qkv = dream.params["layers"][0]["attn"]["qkv"][leaf][...]
            assert [s.data.shape[-1] for s in qkv.addressable_shards] == [32] * 4, leaf
            q, k, v = split_qkv(np.asarray(single.params["layers"][0]["attn"]["qkv"][leaf][...]), 2, 8)
            for shard in qkv.addressable_shards:  # device r: query heads 2r, 2r+1, then KV head r // 2
                r = shard.index[-1].start // 32
                group = np.asarray(shard.data).reshape(*shard.data.shape[:-1], 4, 8)
                queries = group[..., :2, :].reshape(*group.shape[:-2], -1)
                np.testing.assert_array_equal(queries, q[..., r * 16:r * 16 + 16])
                for i, part in ((2, k), (3, v)):
                    np.testing.assert_array_equal(group[..., i, :], part[..., r // 2 * 8:r // 2 * 8 + 8])
        np.testing.assert_allclose(np.asarray(dream.logits(ids)), np.asarray(single.logits(ids)), rtol=1e-5, atol=1e-5)
    pool = Engine(dream, DecodeConfig(gen_length=16, block_length=8, cache="dual"), pool_tokens=64, block_size=8
                  ).runner.pool.k[0]
    assert pool.sharding.spec[1] == "model" and {s.data.shape for s in pool.addressable_shards} == {(64, 1, 8)}
    affix = acache_jax.build_affix_cache(dream, AFFIX)
    assert {s.data.shape for s in affix.k[0].addressable_shards} == {(len(AFFIX), 1, 8)}
    # Bad meshes: one clear error each.
    for (tp, dp), message in (((3, 1), "does not divide the model's attention heads"),
                              ((8, 2), "= 16 devices, but only 8 are present"),
                              ((0, 1), "must be a positive integer")):
        try:
            acache_jax.load(dirs["llada"], mesh=make_mesh(tp, dp))
        except MeshError as e:
            assert message in str(e), e
        else:
            raise AssertionError(f"tp {tp} dp {dp} was accepted")
    odd = ModelConfig.from_hf(hf_checkpoints.dream_config(hidden_size=48, num_attention_heads=6,
                                                          num_key_value_heads=3, intermediate_size=96))
    try:
        check_mesh(make_mesh(2), odd)
    except MeshError as e:
        assert "must divide the model's 3 KV heads or be a multiple of them" in str(e), e
    else:
        raise AssertionError("2 devices for 3 KV heads was accepted")
    print("loading ok")


# (family, cache, extra settings, mesh (tp, dp)): every policy and both families, tp 2/4 and dp 1/2
# each at least once, the Pallas kernels (interpreted) through shard_map on both families and the
# jnp path through the partitioner.
STATIC = [
    ("llada", "dual", dict(temperature=0.7), (2, 2)),
    ("llada", "acache", dict(anchor_ratio=0.3, selector="attention", attn_backend="pallas"), (4, 1)),
    ("dream", "prefix", dict(threshold=None, steps=8), (2, 2)),
    ("dream", "acache", dict(anchor_ratio=0.3, selector="hkvd"), (4, 2)),
    ("dream", "direct", dict(attn_backend="pallas"), (2, 1)),
]
ENGINE = [
    ("llada", "dual", dict(temperature=0.7), (4, 1)),
    ("dream", "acache", dict(anchor_ratio=0.3, attn_backend="pallas"), (4, 2)),
    ("dream", "direct", dict(threshold=None, steps=8), (2, 1)),
]


def check_parity(workdir: Path, engine: bool) -> None:
    """The same tokens (and anchors, NFE) on a mesh as on one device, in float32."""
    dirs = model_dirs(workdir)
    single = {f: acache_jax.load(d, dtype="float32") for f, d in dirs.items()}
    meshed = {}
    cases = ENGINE if engine else STATIC
    for family, cache, extra, (tp, dp) in cases:
        if (family, tp, dp) not in meshed:
            meshed[family, tp, dp] = acache_jax.load(dirs[family], dtype="float32", mesh=make_mesh(tp, dp))
        model = meshed[family, tp, dp]
        cfg = DecodeConfig(gen_length=16, block_length=8, cache=cache, **extra)
        want = generate(single[family], REQUESTS, cfg, affix=AFFIX)
        if engine:
            results = Engine(model, cfg, pool_tokens=200, block_size=8, max_batch=2).generate(REQUESTS, AFFIX)
            got = [(r.tokens, r.anchors, r.nfe) for r in results]
        else:
            out = generate(model, REQUESTS, cfg, affix=AFFIX)
            got = list(zip(out.tokens, out.anchors, out.nfe))
        for i, (tokens, anchors, nfe) in enumerate(got):
            case = (family, cache, tp, dp, i)
            assert tokens.tolist() == want.tokens[i].tolist(), case
            assert anchors.tolist() == want.anchors[i].tolist() and nfe == want.nfe[i], case
        print("parity ok", "engine" if engine else "static", family, cache, f"tp {tp} dp {dp}")


def collectives(text: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective in compiled HLO text."""
    return re.findall(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                      text)


def check_fusion_is_local(workdir: Path) -> None:
    """Loading's device programs on a mesh move no bytes between devices: the fusion of each fused
    parameter from its placed parts (MHA LLaDA; Dream-GQA, split by KV head at tp 2 and with its KV
    heads copied at tp 4) and the re-layout of a converted qkv leaf for the copies compile to no
    collective."""
    from acache_jax.network import sharding
    from acache_jax.network.hf_checkpoint import key_map

    for directory, tp in itertools.product((FIXTURES / "llada", dream_gqa(workdir)), (2, 4)):
        mesh = make_mesh(tp)
        cfg = ModelConfig.from_file(directory)
        copies = sharding.kv_copies(cfg, tp)
        entries = [e for e in key_map(cfg).values() if e.part is not None and e.path[1] == 0]
        for path in dict.fromkeys(e.path for e in entries):
            module = path[-2]
            parts = [sharding.place_param(path, np.zeros(e.hf_shape, np.float32), cfg, mesh, np.float32,
                                          transposed=e.transpose, part=e.part)
                     for e in sorted((e for e in entries if e.path == path),
                                     key=lambda e: sharding.FUSED_PARTS[module].index(e.part))]
            fuse = sharding._fuse(module, cfg.num_kv_heads, cfg.head_dim, copies if module == "qkv" else 1,
                                  sharding.param_sharding(mesh, path))
            assert collectives(fuse.lower(*parts).compile().as_text()) == [], (directory.name, tp, path)
            if module == "qkv" and copies > 1:  # a converted leaf: stored without copies, placed whole
                stored = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
                whole = jax.device_put(np.zeros(stored, np.float32), NamedSharding(mesh, jax.sharding.PartitionSpec()))
                relayout = sharding._relayout(np.dtype(np.float32), False, copies, cfg.num_kv_heads, cfg.head_dim,
                                              sharding.param_sharding(mesh, path))
                assert collectives(relayout.lower(whole).compile().as_text()) == [], (directory.name, tp, path)


def check_hlo(workdir: Path) -> None:
    """Tensor parallelism compiles to Megatron's collectives: per layer one all-reduce after attention
    and one after the MLP (+ one for the embedding lookup of the vocabulary-split table), and no
    all-gather of a weight or of the pool; the sampler's max over the vocabulary-split logits
    gathers only [rows, block, tp] partials."""
    from acache_jax.engine import runner
    from acache_jax.network.model import ForwardInputs, _jit_forward
    from acache_jax.network.sharding import use_mesh

    check_fusion_is_local(workdir)
    model = acache_jax.load(FIXTURES / "llada", dtype="float32", mesh=make_mesh(4))
    layers = model.config.num_layers
    whole = {tuple(leaf.shape) for _, leaf in nnx_leaves(model)}
    with use_mesh(model.mesh):
        tokens = jax.numpy.zeros((2, 16), jax.numpy.int32)
        dense = _jit_forward.lower(*model.flat, tokens,
                                   ForwardInputs(jax.numpy.broadcast_to(jax.numpy.arange(16), (2, 16)))).compile()
    found = collectives(dense.as_text())
    assert [kind for _, kind in found] == ["all-reduce"] * (2 * layers + 1), found
    for backend in ("xla",):  # the Pallas kernels' shard_map names the pool's split in its in_specs
        cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.3, attn_backend=backend)
        engine = Engine(model, cfg, pool_tokens=200, block_size=8, max_batch=2)
        compiled = []
        step = runner.block_loop

        def capture(*args):
            compiled.append(step.lower(*args).compile().as_text())
            return step(*args)

        runner.block_loop = capture
        try:
            engine.generate(REQUESTS[:2], AFFIX)
        finally:
            runner.block_loop = step
        pool_shape = tuple(engine.runner.pool.k[0].shape)
        for text in compiled:
            found = collectives(text)
            kinds = [kind for _, kind in found]
            assert kinds.count("all-reduce") >= 2 * layers + 1 and set(kinds) <= {"all-reduce", "all-gather"}, found
            for shape, kind in found:
                dims = tuple(int(d) for d in re.findall(r"\d+", shape.split("{")[0].split("[", 1)[-1]))
                assert kind != "all-gather" or (dims[-1] == 4 and dims not in whole | {pool_shape}), (backend, found)
    print("hlo ok")


if __name__ == "__main__":
    group, workdir = sys.argv[1], Path(sys.argv[2])
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    {"loading": lambda: check_loading(workdir), "static": lambda: check_parity(workdir, engine=False),
     "engine": lambda: check_parity(workdir, engine=True), "hlo": lambda: check_hlo(workdir)}[group]()

"""HF checkpoint -> our checkpoint: round trips through both load paths, and bad inputs."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import acache_jax
from acache_jax.network.config import ConfigError
from convert import CheckpointError, convert
from tests.hf_checkpoints import dream_config, llada_config, random_weights, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
IDS = np.array([[1, 5, 9, 2, 7, 3, 0], [4, 4, 8, 1, 6, 2, 5]], np.int32)


def _hf(tmp_path, cfg, shards=1, weights=None, name="hf"):
    weights = random_weights(cfg, seed=1) if weights is None else weights
    return write_checkpoint(tmp_path / name, cfg, weights, shards=shards)


def _leftovers(parent: Path, dst_name: str):
    return [p.name for p in parent.iterdir() if p.name.startswith(dst_name) or ".partial-" in p.name]


@pytest.mark.parametrize("cfg,shards", [(llada_config(n_kv_heads=2, include_qkv_bias=True), 3), (dream_config(), 1)])
def test_round_trip_cli_and_both_load_paths(tmp_path, cfg, shards):
    src = _hf(tmp_path, cfg, shards)
    (src / "tokenizer_config.json").write_text("{}")
    dst = tmp_path / "converted"
    run = subprocess.run([sys.executable, "-m", "convert", str(src), str(dst), "--dtype", "float32"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (dst / "config.json").is_file() and (dst / "tokenizer_config.json").is_file()
    from_hf = np.asarray(acache_jax.load(src, dtype="float32").logits(IDS))
    from_converted = np.asarray(acache_jax.load(dst).logits(IDS))
    np.testing.assert_array_equal(from_hf, from_converted)


def test_bfloat16_conversion_loads_as_bfloat16_and_upcasts(tmp_path):
    src = _hf(tmp_path, llada_config())
    dst = convert(src, tmp_path / "bf16", dtype="bfloat16")
    model = acache_jax.load(dst)
    assert model.dtype == np.dtype("bfloat16")
    ref = np.asarray(acache_jax.load(src, dtype="bfloat16").logits(IDS))
    np.testing.assert_array_equal(np.asarray(model.logits(IDS)), ref)
    assert acache_jax.load(dst, dtype="float32").dtype == np.float32


def test_missing_tensor(tmp_path):
    cfg = llada_config()
    weights = random_weights(cfg)
    del weights["model.transformer.blocks.1.up_proj.weight"]
    src = _hf(tmp_path, cfg, shards=2, weights=weights)
    with pytest.raises(CheckpointError, match=r"missing \(1\): model\.transformer\.blocks\.1\.up_proj\.weight"):
        convert(src, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []
    with pytest.raises(CheckpointError, match="missing"):
        acache_jax.load(src)


def test_wrong_shape_and_unexpected_listed_together(tmp_path):
    cfg = dream_config()
    weights = random_weights(cfg)
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((9, 56), np.float32)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((4,), np.float32)
    src = _hf(tmp_path, cfg, weights=weights)
    with pytest.raises(CheckpointError) as err:
        convert(src, tmp_path / "out")
    message = str(err.value)
    assert "wrong shape (1): model.layers.0.self_attn.k_proj.weight: (9, 56) (expected (8, 56))" in message
    assert "unexpected (1): model.layers.0.self_attn.rotary_emb.inv_freq" in message
    assert _leftovers(tmp_path, "out") == []


def test_unknown_model_type(tmp_path):
    src = _hf(tmp_path, llada_config())
    (src / "config.json").write_text(json.dumps(llada_config(model_type="llama")))
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        convert(src, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []


def test_missing_config_field_is_named(tmp_path):
    cfg = dream_config()
    del cfg["num_key_value_heads"]
    with pytest.raises(ConfigError, match="lacks required field 'num_key_value_heads'"):
        acache_jax.ModelConfig.from_hf(cfg)


def test_unsupported_option_is_named():
    with pytest.raises(ConfigError, match="weight_tying=True"):
        acache_jax.ModelConfig.from_hf(llada_config(weight_tying=True))


def test_truncated_safetensors(tmp_path):
    src = _hf(tmp_path, llada_config(), shards=2)
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: truncated or not a safetensors file"):
        convert(src, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []


def test_existing_nonempty_destination_is_left_alone(tmp_path):
    src = _hf(tmp_path, llada_config())
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    run = subprocess.run([sys.executable, "-m", "convert", str(src), str(dst)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2
    assert "exists and is not an empty directory" in run.stderr
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_empty_destination_directory_is_used(tmp_path):
    src = _hf(tmp_path, llada_config())
    (tmp_path / "out").mkdir()
    convert(src, tmp_path / "out", dtype="float32")
    assert acache_jax.load(tmp_path / "out").config.family == "llada"


def test_load_rejects_non_model_directory(tmp_path):
    with pytest.raises(acache_jax.InputError, match="does not exist"):
        acache_jax.load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        acache_jax.load(tmp_path)


def test_tensor_larger_than_the_write_limit_converts(tmp_path, monkeypatch):
    """Orbax refuses to write a tensor larger than its in-flight byte limit (a real 8B model's 1 GB
    embedding against the 1 GB default): the converter raises the limit to the largest tensor."""
    import acache_jax.network.checkpoint

    cfg = llada_config()
    src = _hf(tmp_path, cfg, shards=2)
    embed = random_weights(cfg, seed=1)["model.transformer.wte.weight"]
    limit = embed.nbytes // 4
    monkeypatch.setattr(acache_jax.network.checkpoint, "SAVE_IN_FLIGHT_BYTES", limit)
    dst = convert(src, tmp_path / "out", dtype="float32")
    converted, snapshot = acache_jax.load(dst), acache_jax.load(src, dtype="float32")
    for (path, a), (_, b) in zip(jax_leaves(converted), jax_leaves(snapshot), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=str(path))
    assert embed.nbytes > limit


def jax_leaves(model):
    import jax
    from flax import nnx

    return jax.tree_util.tree_flatten_with_path(jax.device_get(nnx.to_pure_dict(model.params)))[0]


@pytest.mark.parametrize("cfg", [llada_config(), dream_config()], ids=["llada", "dream"])
def test_the_host_only_reads_bytes_the_device_transposes_and_casts(tmp_path, monkeypatch, cfg):
    """Loading hands the device each tensor exactly as the file stores it (PyTorch [out, in]
    layout, float32 here), and the device makes our [in, out] bfloat16 kernels of it."""
    import jax

    from acache_jax.network.hf_checkpoint import key_map
    from acache_jax.network.sharding import split_parts

    weights = random_weights(cfg, seed=3)
    src = _hf(tmp_path, cfg, shards=2, weights=weights)
    handed: list[np.ndarray] = []
    device_put = jax.device_put

    def spy(x, *args, **kwargs):
        if isinstance(x, np.ndarray):
            handed.append(x)
        return device_put(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    model = acache_jax.load(src, dtype="bfloat16")
    monkeypatch.undo()
    # Every tensor went to the device once, as stored: same bytes, dtype and layout.
    by_bytes = {w.tobytes(): name for name, w in weights.items()}
    assert sorted(by_bytes[h.tobytes()] for h in handed) == sorted(weights)
    assert all(h.dtype == np.float32 and h.flags.c_contiguous for h in handed)
    leaves = dict((tuple(k.key for k in path), leaf) for path, leaf in jax_leaves(model))
    for name, entry in key_map(model.config).items():
        want = weights[name].T if entry.transpose else weights[name]
        got = leaves[entry.path]
        if entry.part is not None:  # one part of a fused parameter
            got = split_parts(entry.path[-2], got, model.config.num_kv_heads, model.config.head_dim)[entry.part]
        assert got.dtype == np.dtype("bfloat16"), name
        np.testing.assert_array_equal(got, want.astype(np.dtype("bfloat16")), err_msg=name)


@pytest.mark.parametrize("cfg", [llada_config(), dream_config(num_attention_heads=4, num_key_value_heads=2)],
                         ids=["llada", "dream-gqa"])
def test_a_snapshot_load_compiles_ahead_every_program_it_runs(tmp_path, monkeypatch, cfg):
    """Loading a snapshot compiles its programs on a thread of its own while it reads
    (`sharding.compiling_ahead`): what it foresees is exactly what placing the tensors, fusing the
    parts and the finiteness check then call, signature for signature, so that none of them compiles
    a program on the loading threads, and nothing is compiled that no call needs."""
    from flax import nnx

    from acache_jax.network import checkpoint, sharding
    from acache_jax.network.hf_checkpoint import key_map
    from tests.mesh_checks import foreseen_and_called

    src = _hf(tmp_path, cfg, shards=2)
    foreseen, called = foreseen_and_called(monkeypatch.setattr)
    model = acache_jax.load(src, dtype="bfloat16")  # the files hold float32: every tensor is cast
    leaves = [a for _, a in checkpoint._finite_order(checkpoint._flatten(nnx.to_pure_dict(model.params)))]
    called.add(sharding._signature(checkpoint._all_finite, (leaves,)))
    assert len(foreseen) == len(set(foreseen)) and set(foreseen) == called
    # one cast (and transpose) per kind of stored tensor, one fusion per kind of fused leaf, the check
    entries = key_map(model.config).values()
    kinds = {(e.hf_shape, e.transpose) for e in entries}
    fused = {e.path[-2:] for e in entries if e.part is not None}  # qkv kernel (and bias), gate_up kernel
    assert len(called) == len(kinds) + len(fused) + 1


def test_copies_go_on_while_a_relayout_waits_for_its_program(tmp_path, monkeypatch):
    """A snapshot's bytes keep going to the device while a relayout or fusion waits for its program
    (an 8B load's placing threads waited on the compiling thread with a gigabyte in flight): the
    bound on bytes in flight counts copies, not tensors waiting for their relayout. Here the bound
    is one tensor and no program runs until every tensor is copied; a loader that waited for a
    relayout before copying more would stop (the wait's timeout) instead of loading."""
    import threading

    from acache_jax.network import checkpoint, sharding
    from acache_jax.network.config import ModelConfig
    from acache_jax.network.hf_checkpoint import key_map

    cfg = dream_config()  # biases too: a fusion of parts that need no relayout
    src = _hf(tmp_path, cfg, shards=2)
    tensors = len(key_map(ModelConfig.from_file(src)))
    copied, all_copied = [], threading.Event()
    transfer, call = checkpoint.transfer_param, sharding._call

    def counting(*args, **kwargs):
        out = transfer(*args, **kwargs)
        copied.append(out)
        if len(copied) == tensors:
            all_copied.set()
        return out

    def waiting(program, *arrays):
        if program is not checkpoint._all_finite:  # the check runs once all is placed
            assert all_copied.wait(30), f"a relayout waited with {len(copied)} of {tensors} tensors copied"
        return call(program, *arrays)

    monkeypatch.setattr(checkpoint, "IN_FLIGHT_BYTES", 1)
    monkeypatch.setattr(checkpoint, "transfer_param", counting)
    monkeypatch.setattr(sharding, "_call", waiting)
    model = acache_jax.load(src, dtype="float32")  # as stored: a waiting tensor holds nothing beyond its parameter
    monkeypatch.undo()
    assert len(copied) == tensors
    np.testing.assert_array_equal(np.asarray(model.logits(IDS)), np.asarray(acache_jax.load(src).logits(IDS)))


def test_loads_build_the_abstract_model_once_on_the_compiling_thread(tmp_path, monkeypatch):
    """The network's shape-only model (0.15 s to build at 8B size, which a snapshot's load spent
    after its read) is built once per config and dtype, on the thread compiling ahead while the files
    are read; each load fills a copy of it, so the cached one stays shape-only and two loads share
    no parameter."""
    import threading

    import jax
    from flax import nnx

    from acache_jax.network import checkpoint
    src = _hf(tmp_path, llada_config(), shards=2)
    built = []
    build = checkpoint.abstract_transformer
    monkeypatch.setattr(checkpoint, "abstract_transformer",
                        lambda *args: built.append(threading.current_thread().name) or build(*args))
    checkpoint._abstract_split.cache_clear()
    first, second = acache_jax.load(src), acache_jax.load(src)
    assert built == ["compile-ahead"]
    _, cached = checkpoint._abstract_model(first.config, np.float32)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(nnx.to_pure_dict(cached)))
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(first.params)), jax.tree.leaves(nnx.to_pure_dict(second.params)),
                    strict=True):
        assert a is not b and isinstance(a, jax.Array)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cfg,dtype", [(llada_config(n_kv_heads=2, include_qkv_bias=True), "float32"),
                                       (dream_config(num_attention_heads=4, num_key_value_heads=2), "bfloat16")],
                         ids=["llada-float32", "dream-bfloat16"])
def test_snapshot_load_export_gives_back_the_same_tensors(tmp_path, cfg, dtype):
    """HF snapshot -> load (q/k/v and gate/up fused on the device) -> export_hf (split back): every
    tensor of the snapshot, byte for byte, under its own name (sharded source, GQA, biases)."""
    import ml_dtypes
    from safetensors.numpy import load_file

    from acache_jax.network.hf_checkpoint import export_hf

    weights = {k: w.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
               for k, w in random_weights(cfg, seed=4).items()}
    src = _hf(tmp_path, cfg, shards=3, weights=weights)
    model = acache_jax.load(src)
    assert model.dtype == np.dtype(dtype)
    export_hf(tmp_path / "exported", model.config, model.params, dtype=dtype)
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert sorted(exported) == sorted(weights)
    for name, tensor in weights.items():
        assert exported[name].dtype == tensor.dtype and exported[name].tobytes() == tensor.tobytes(), name


def test_a_converted_checkpoint_of_format_1_is_refused_by_name(tmp_path):
    """Format 1 stored q/k/v and gate/up apart; loading one says to convert again."""
    dst = convert(_hf(tmp_path, llada_config()), tmp_path / "converted", dtype="float32")
    marker = json.loads((dst / "acache.json").read_text())
    assert marker["format"] == 2
    (dst / "acache.json").write_text(json.dumps({**marker, "format": 1}))
    with pytest.raises(CheckpointError, match=r"written by an older version of acache-jax \(checkpoint format 1; "
                                              r".*convert the model again from its HF snapshot"):
        acache_jax.load(dst)


@pytest.mark.parametrize("stored", [np.int32, np.bool_, np.int8])
def test_a_weight_of_an_unsupported_dtype_is_named(tmp_path, stored):
    cfg = dream_config()
    weights = random_weights(cfg)
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = (weights[name] * 10).astype(stored)
    src = _hf(tmp_path, cfg, shards=2, weights=weights)
    dtype = {np.int32: "I32", np.bool_: "BOOL", np.int8: "I8"}[stored]
    message = rf"unsupported dtype, not one of BF16, F16, F32, F64 \(1\): {re.escape(name)}: {dtype}"
    with pytest.raises(CheckpointError, match=message):
        convert(src, tmp_path / "out")
    assert _leftovers(tmp_path, "out") == []
    with pytest.raises(CheckpointError, match=message):
        acache_jax.load(src)


def test_both_formats_run_the_same_programs(tmp_path, monkeypatch):
    """A converted directory's weights are placed as a snapshot's are (uncommitted, and checked for
    NaN in the same order): each program over them is the same, and so is its compilation cache entry."""
    import jax
    from acache_jax.network import checkpoint
    src = _hf(tmp_path, llada_config(), shards=2)
    dst = convert(src, tmp_path / "converted", dtype="float32")
    checks, all_finite = [], checkpoint._all_finite
    monkeypatch.setattr(checkpoint, "_all_finite", lambda leaves: checks.append(all_finite.lower(leaves).as_text())
                        or all_finite(leaves))
    models = [acache_jax.load(src, dtype="float32"), acache_jax.load(dst)]
    assert checks[0] == checks[1]
    assert not any(leaf.committed for m in models for leaf in jax.tree.leaves(m.params))
    program = jax.jit(lambda params: jax.tree.map(lambda a: a.sum(), params))
    assert program.lower(models[0].params).as_text() == program.lower(models[1].params).as_text()

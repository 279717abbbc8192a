"""Tensor and data parallelism on 8 forced host devices (tests/mesh_checks.py, in subprocesses:
the device count must be set before jax is imported), and the mesh rules that need no devices.

The subprocesses start together when the first test here asks for them and run side by side.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from acache_jax.network.config import ModelConfig
from acache_jax.network.model import abstract_transformer
from acache_jax.network.sharding import (MeshError, check_mesh, fuse_gate_up, fuse_parts, fuse_qkv, kv_copies,
                                         make_mesh, param_axes, repeat_kv_heads, split_gate_up, split_parts, split_qkv)
from tests import hf_checkpoints

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("loading", "static", "engine", "hlo")
LLADA = ROOT / "tests" / "fixtures" / "decode" / "llada"


def _env() -> dict[str, str]:
    flags = os.environ.get("XLA_FLAGS", "")
    return {**os.environ, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=8",
            "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every check group and CLI run started at once; each test waits for its own."""
    work = tmp_path_factory.mktemp("mesh")
    start = lambda args, **env: subprocess.Popen(args, cwd=ROOT, env=_env() | env, stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True)
    procs = {g: start([sys.executable, "tests/mesh_checks.py", g, str(work / g)]) for g in GROUPS}
    cli = [sys.executable, "-m", "acache_jax.generate", "--model", str(LLADA), "--prompt-ids", "5,17,33,2,90",
           "--gen-length", "16", "--block-length", "8", "--cache", "dual", "--json", "--dtype", "float32"]
    procs["cli-single"] = start(cli)
    procs["cli-static"] = start(cli + ["--tensor-parallel-size", "2", "--data-parallel-size", "2"])
    procs["cli-engine"] = start(cli + ["--engine", "--tensor-parallel-size", "4", "--data-parallel-size", "2"])
    procs["cli-bad"] = start(cli + ["--tensor-parallel-size", "8", "--data-parallel-size", "2"])
    procs["cli-heads"] = start(cli + ["--tensor-parallel-size", "3"])
    with socket.socket() as s:  # a free port for a one-process jax.distributed cluster
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs["cli-distributed"] = start(cli + ["--distributed", "--tensor-parallel-size", "2"],
                                     JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")
    yield procs
    for p in procs.values():
        p.kill()


def _wait(runs, name, timeout=600):
    proc = runs[name]
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.mark.parametrize("group", GROUPS)
def test_mesh_checks(runs, group):
    rc, out, err = _wait(runs, group)
    assert rc == 0, f"{out}\n{err[-3000:]}"
    assert "ok" in out


def test_cli_flags_give_the_same_tokens(runs):
    """Static and engine on meshes, and --distributed on a one-process cluster: the one-device tokens."""
    rc, single, err = _wait(runs, "cli-single")
    assert rc == 0, err
    for name in ("cli-static", "cli-engine", "cli-distributed"):
        rc, out, err = _wait(runs, name)
        assert rc == 0, err
        # the last line: jax.distributed's CPU collectives (Gloo) print their connections on stdout
        assert json.loads(out.splitlines()[-1])["tokens"] == json.loads(single)["tokens"], name


def test_cli_bad_mesh_is_one_line(runs):
    for name, message in (("cli-bad", "tensor parallel 8 x data parallel 2 = 16 devices, but only 8 are present"),
                          ("cli-heads", "tensor parallel size 3 does not divide the model's attention heads (4)")):
        rc, out, err = _wait(runs, name)
        assert rc == 2 and err.strip().splitlines() == [f"error: {message}"], (rc, err)


def test_param_axes_cover_every_parameter():
    """Every leaf of both families has logical axes, one per dimension, with the right split axes."""
    for hf in (hf_checkpoints.llada_config(), hf_checkpoints.dream_config()):
        cfg = ModelConfig.from_hf(hf)
        abstract = nnx.split(abstract_transformer(cfg, "float32"))[1]
        flat, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))
        for path, leaf in flat:
            keys = tuple(k.key for k in path)
            assert len(param_axes(keys)) == leaf.ndim, keys
    assert param_axes(("layers", 0, "attn", "o", "kernel")) == ("heads", "embed")
    assert param_axes(("layers", 0, "attn", "qkv", "kernel")) == ("embed", "kv_heads")
    assert param_axes(("layers", 0, "attn", "qkv", "bias")) == ("kv_heads",)
    assert param_axes(("layers", 0, "mlp", "gate_up", "kernel")) == ("embed", "mlp")
    assert param_axes(("lm_head", "kernel")) == ("embed", "vocab")


def test_kv_heads_are_copied_in_order():
    cfg = ModelConfig.from_hf(hf_checkpoints.dream_config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2))
    assert kv_copies(cfg, 2) == 1 and kv_copies(cfg, 8) == 4
    kernel = np.arange(3 * 16).reshape(3, 16)  # 2 heads of 8
    out = np.asarray(repeat_kv_heads(kernel, 2, 8, 2)).reshape(3, 4, 8)
    assert (out[:, 0] == out[:, 1]).all() and (out[:, 1] == kernel[:, :8]).all() and (out[:, 2] == kernel[:, 8:]).all()
    assert repeat_kv_heads(kernel, 2, 8, 1) is kernel


@pytest.mark.parametrize("copies", [1, 2, 4])
def test_qkv_layout_round_trips_and_groups_query_heads_with_their_kv_head(copies):
    """fuse_qkv -> split_qkv gives q back and k, v with each KV head `copies` times (repeat_kv_heads);
    group j of the fused columns holds query heads j*G .. j*G+G-1, then k and v of checkpoint KV head
    j // copies, which is the KV head those query heads read (h // (heads / kv_heads)); tp = the
    groups' count splits the columns into whole groups."""
    heads, kv, hd, d = 8, 2, 4, 3
    rng = np.random.default_rng(copies)
    q, k, v = (rng.standard_normal((d, n * hd)).astype(np.float32) for n in (heads, kv, kv))
    groups, per_group = kv * copies, heads // (kv * copies)
    fused = np.asarray(fuse_qkv(q, k, v, kv, hd, copies))
    assert fused.shape == (d, groups * (per_group + 2) * hd)
    back = split_qkv(fused, groups, hd)
    for got, want in zip(back, (q, repeat_kv_heads(k, kv, hd, copies), repeat_kv_heads(v, kv, hd, copies))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    head = lambda a, i: a[:, i * hd:(i + 1) * hd]  # noqa: E731
    for device, columns in enumerate(np.split(fused, groups, axis=1)):  # tp = groups: one group a device
        group = columns.reshape(d, per_group + 2, hd)
        for g in range(per_group):
            h = device * per_group + g
            np.testing.assert_array_equal(group[:, g], head(q, h))
            np.testing.assert_array_equal(group[:, per_group], head(k, h // (heads // kv)))
            np.testing.assert_array_equal(group[:, per_group + 1], head(v, h // (heads // kv)))
    bias = [rng.standard_normal(n * hd).astype(np.float32) for n in (heads, kv, kv)]
    np.testing.assert_array_equal(np.asarray(split_qkv(np.asarray(fuse_qkv(*bias, kv, hd)), kv, hd)[0]), bias[0])
    parts = split_parts("qkv", np.asarray(fuse_parts("qkv", (q, k, v), kv, hd)), kv, hd)
    assert list(parts) == ["q", "k", "v"] and all(np.array_equal(parts[n], a) for n, a in zip("qkv", (q, k, v)))


def test_gate_up_layout_round_trips_in_whole_pairs():
    gate, up = np.arange(12.0).reshape(2, 6), -np.arange(12.0).reshape(2, 6)
    fused = np.asarray(fuse_gate_up(gate, up))
    assert fused.shape == (2, 12)
    np.testing.assert_array_equal(fused[:, 0::2], gate)  # columns in (gate_f, up_f) pairs
    np.testing.assert_array_equal(fused[:, 1::2], up)
    for tp in (1, 2, 3, 6):  # each device's columns are the gate and up of the same hidden units
        for r, columns in enumerate(np.split(fused, tp, axis=1)):
            units = slice(r * 6 // tp, (r + 1) * 6 // tp)
            np.testing.assert_array_equal(np.stack(split_gate_up(columns)), np.stack([gate[:, units], up[:, units]]))
    parts = split_parts("gate_up", fused, 1, 1)
    assert list(parts) == ["gate", "up"] and np.array_equal(parts["gate"], gate) and np.array_equal(parts["up"], up)


def test_bad_meshes_are_named():
    cfg = ModelConfig.from_hf(hf_checkpoints.dream_config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(MeshError, match="only 1 are present"):
        make_mesh(2)
    with pytest.raises(MeshError, match="tensor_parallel must be a positive integer"):
        make_mesh(0)
    check_mesh(make_mesh(1), cfg)  # one device: anything goes

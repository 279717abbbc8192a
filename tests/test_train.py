"""Training: the forward process, the loss going down, resuming, the HF export round trip, model sizes."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

import acache_jax
from acache_jax.network.config import DecodeConfig, ModelConfig
from acache_jax.network.hf_checkpoint import export_hf, hf_config
from acache_jax.network.model import ForwardInputs, Model, Transformer
from eval.tokenizer import build_tokenizer, special_ids
from eval.plot_losses import plot_losses
from eval.train import (SIZES, Recipe, TrainState, corrupt, initial_model, model_config, one_hot_embeddings,
                        optimizer, starting_point, train, train_step)
from eval.train_data import Mixture, build_pool
from tests.hf_checkpoints import hf_shapes

IDS = dict(mask_token_id=2, eos_token_id=3, pad_token_id=0)
SMALL = Mixture(("codebook",), (1.0,), max_shots=1)  # short sequences: fits seq_len 128


def _tiny(family: str) -> ModelConfig:
    """One layer, one 64-wide head: the smallest model with the shipped head_dim."""
    kv = {"num_kv_heads": 1}
    return ModelConfig(family=family, vocab_size=256, hidden_size=64, num_layers=1, num_heads=1, head_dim=64,
                       intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-6, max_seq_len=512,
                       qkv_bias=family == "dream", **kv, **IDS)


def test_initial_embeddings_share_one_direction():
    cfg = _tiny("llada")
    plain = initial_model(cfg, Recipe(shared_embedding=0.0), seed=3).embed[...]
    shifted = initial_model(cfg, Recipe(shared_embedding=2.0), seed=3).embed[...]
    np.testing.assert_array_equal(plain, Transformer(cfg, rngs=nnx.Rngs(3)).embed[...])
    offset = np.asarray(shifted - plain)
    np.testing.assert_allclose(offset, np.broadcast_to(offset[0], offset.shape), atol=1e-6)  # one vector for all
    assert 1.5 * np.sqrt(cfg.hidden_size) < np.linalg.norm(offset[0]) < 2.5 * np.sqrt(cfg.hidden_size)


def test_one_hot_embedding_has_the_lookups_values_and_gradients():
    cfg = _tiny("dream")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)))
    ids = ids.at[:, 3:9].set(cfg.mask_token_id)  # repeated ids: where the lookup's scatter-add slows down
    positions = jnp.broadcast_to(jnp.arange(12), ids.shape)

    def loss(p, one_hot):
        network = nnx.merge(graphdef, p)
        embeddings = one_hot_embeddings(network.embed[...], ids) if one_hot else None
        return jnp.sum(network(ids, ForwardInputs(positions), embeddings=embeddings).logits[..., :7] ** 2)

    (plain, g_plain), (hot, g_hot) = (jax.value_and_grad(loss)(params, flag) for flag in (False, True))
    np.testing.assert_allclose(hot, plain, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_hot), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(g_hot["embed"][...][cfg.mask_token_id]).sum()) > 0  # the repeated id's row is trained


@pytest.fixture(scope="module")
def pool():
    tok = build_tokenizer()
    ids = special_ids(tok)
    return build_pool(tok, 64, 128, seed=0, mixture=SMALL, eos_id=ids["eos_token_id"], pad_id=ids["pad_token_id"])


def test_pool_is_seeded_and_laid_out_like_inference(pool):
    tok = build_tokenizer()
    ids = special_ids(tok)
    again = build_pool(tok, 64, 128, seed=0, mixture=SMALL, eos_id=ids["eos_token_id"], pad_id=ids["pad_token_id"])
    other = build_pool(tok, 64, 128, seed=1, mixture=SMALL, eos_id=ids["eos_token_id"], pad_id=ids["pad_token_id"])
    np.testing.assert_array_equal(pool.tokens, again.tokens)
    assert not np.array_equal(pool.tokens, other.tokens)
    for row, start, length in zip(pool.tokens, pool.gen_start, pool.length):
        gen = row[start:start + 32].tolist()
        assert tok.id_to_token(int(row[start - 1])) == "<|assistant|>"  # the generation follows the prompt
        assert gen[-1] == ids["eos_token_id"] and ids["pad_token_id"] not in gen
        assert (row[length:] == ids["pad_token_id"]).all() and ids["pad_token_id"] not in row[:length].tolist()
    with pytest.raises(ValueError, match="too short for this mixture"):
        build_pool(tok, 4, 40, seed=0, mixture=SMALL, eos_id=ids["eos_token_id"], pad_id=ids["pad_token_id"])


def test_forward_process_masks_only_the_generation_region():
    recipe = Recipe(batch=64, gen_length=8, pretrain_fraction=0.0)
    tokens = jnp.tile(jnp.arange(3, 43, dtype=jnp.int32), (64, 1))
    gen_start = jnp.arange(64, dtype=jnp.int32) % 20 + 5
    length = jnp.full((64,), 36, jnp.int32)
    noisy, region, masked, ratio = corrupt(tokens, gen_start, length, jax.random.key(0), 0, recipe)
    cols = np.arange(40)[None]
    generation = (cols >= np.asarray(gen_start)[:, None]) & (cols < np.asarray(gen_start)[:, None] + 8)
    assert np.array_equal(np.asarray(region), generation)
    assert bool((masked <= region).all()) and bool((noisy == jnp.where(masked, 0, tokens)).all())
    assert 0 < int(masked.sum()) < int(region.sum())
    gaps = np.diff(np.sort(np.asarray(ratio)))  # stratified: evenly spread over [eps, 1)
    assert ratio.min() >= recipe.mask_eps and ratio.max() <= 1
    assert np.allclose(gaps, (1 - recipe.mask_eps) / 64, atol=1e-5)


def test_pretraining_rows_mask_the_whole_sequence():
    recipe = Recipe(batch=256, gen_length=8, pretrain_fraction=0.5)
    tokens = jnp.tile(jnp.arange(3, 43, dtype=jnp.int32), (256, 1))
    gen_start, length = jnp.full((256,), 20, jnp.int32), jnp.full((256,), 30, jnp.int32)
    _, region, masked, _ = corrupt(tokens, gen_start, length, jax.random.key(1), 0, recipe)
    region = np.asarray(region)
    whole = region[:, 1:30].all(1) & ~region[:, 0] & ~region[:, 30:].any(1)
    generation = np.zeros(40, bool)
    generation[20:28] = True
    sft = (region == generation).all(1)
    assert (whole | sft).all() and 0.4 < whole.mean() < 0.6  # every row is one kind, about half of each
    assert bool((masked <= region).all())


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loss_decreases(family, pool):
    cfg = _tiny(family)
    recipe = Recipe(steps=30, batch=16, lr=3e-3, warmup=3, compute_dtype="float32")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    state = TrainState(params, optimizer(recipe).init(params), jnp.int32(0))
    device_pool = jax.device_put(pool)
    losses = []
    for _ in range(recipe.steps):
        state, loss = train_step(graphdef, recipe, cfg.mask_token_id, state, device_pool, jax.random.key(0))
        losses.append(float(loss))
    assert int(state.step) == recipe.steps
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses


def test_resume_continues_as_if_uninterrupted(tmp_path):
    recipe = Recipe(steps=4, batch=4, warmup=1, compute_dtype="float32")
    kwargs = dict(tiny=True, mixture=SMALL, seq_len=128, pool_size=16, ckpt_every=2, log_every=1, progress=False)
    _, whole = train("dream", tmp_path / "a", recipe, **kwargs)
    train("dream", tmp_path / "b", recipe, **kwargs, max_seconds=0.0)  # out of time after one step
    assert len(json.loads((tmp_path / "b" / "losses.json").read_text())["loss"]) == 1
    assert (tmp_path / "b" / "model.safetensors").is_file()  # what there was got exported
    _, resumed = train("dream", tmp_path / "b", recipe, **kwargs)
    jax.tree.map(np.testing.assert_array_equal, whole, resumed)
    losses = json.loads((tmp_path / "a" / "losses.json").read_text())
    assert losses == json.loads((tmp_path / "b" / "losses.json").read_text()) and len(losses["loss"]) == 4
    model = acache_jax.load(tmp_path / "a")  # the export: HF layout + tokenizer
    assert model.config.family == "dream" and model.tokenizer.mask_token_id == model.config.mask_token_id
    with pytest.raises(SystemExit, match="other settings"):
        train("dream", tmp_path / "a", Recipe(steps=5, batch=4, warmup=1), **kwargs)
    plot_losses(tmp_path / "a" / "losses.json", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fine_tuning_starts_from_the_exported_weights(tmp_path):
    recipe = Recipe(steps=2, batch=4, warmup=0, compute_dtype="float32")
    kwargs = dict(tiny=True, mixture=SMALL, seq_len=128, pool_size=8, log_every=1, progress=False)
    cfg, _ = train("llada", tmp_path / "base", recipe, **kwargs)
    exported = acache_jax.load(tmp_path / "base", "float32").params
    _, start = starting_point(cfg, recipe, seed=5, init=tmp_path / "base")  # the seed no longer matters
    jax.tree.map(np.testing.assert_array_equal, start, exported)
    _, tuned = train("llada", tmp_path / "tuned", recipe, init=tmp_path / "base", **kwargs)
    assert json.loads((tmp_path / "tuned" / "run.json").read_text())["init"] == str(tmp_path / "base")
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, tuned, exported)))  # it trained
    with pytest.raises(ValueError, match="another architecture"):
        train("dream", tmp_path / "wrong", recipe, init=tmp_path / "base", **kwargs)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_export_round_trips_logits(family, tmp_path):
    cfg = _tiny(family)
    assert ModelConfig.from_hf(hf_config(cfg)) == cfg
    module = Transformer(cfg, rngs=nnx.Rngs(3))
    ids = np.array([[5, 9, 0, 0, 17, 3, 4], [8, 8, 0, 1, 2, 3, 0]], np.int32)
    reference = Model.from_module(module)
    export_hf(tmp_path / "f32", cfg, reference.params, dtype="float32")
    np.testing.assert_array_equal(acache_jax.load(tmp_path / "f32").logits(ids), reference.logits(ids))
    export_hf(tmp_path / "bf16", cfg, reference.params)
    loaded = acache_jax.load(tmp_path / "bf16")
    assert loaded.dtype == jnp.bfloat16
    as_bf16 = Model(cfg, reference.graphdef, jax.tree.map(lambda p: p.astype(jnp.bfloat16), reference.params))
    np.testing.assert_array_equal(loaded.logits(ids), as_bf16.logits(ids))
    with safe_open(tmp_path / "bf16" / "model.safetensors", "np") as f:  # names written out independently
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == hf_shapes(hf_config(cfg))


@pytest.mark.parametrize("family", sorted(SIZES))
def test_shipped_sizes_fit_ten_megabytes(family):
    cfg = model_config(family, len(build_tokenizer().get_vocab()), IDS)
    assert cfg.head_dim == 64 and cfg.num_params * 2 <= 10e6
    assert (cfg.num_kv_heads < cfg.num_heads and cfg.qkv_bias) if family == "dream" else not cfg.qkv_bias


def test_accuracy_scores_generated_answers(tmp_path):
    from eval.accuracy import accuracy, binding
    from eval.tokenizer import save_tokenizer

    tokenizer = build_tokenizer()
    cfg = dataclasses.replace(_tiny("llada"), **special_ids(tokenizer))
    save_tokenizer(tokenizer, tmp_path)
    export_hf(tmp_path, cfg, nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1], dtype="float32",
              generation=DecodeConfig(gen_length=32, block_length=32))
    model = acache_jax.load(tmp_path)
    assert model.generation_config.gen_length == 32
    eos, bathroom = model.config.eos_token_id, tokenizer.token_to_id("bathroom")
    assert model.answer_text([bathroom, eos, bathroom]) == "bathroom"
    assert accuracy(model, "babi", "suffix", 1, 2) in (0.0, 0.5, 1.0)
    rows = binding(model, facts=(2,), n=2)
    assert [(r["facts"], r["ask"]) for r in rows] == [(2, "first"), (2, "last")]
    assert all(r["accuracy"] in (0.0, 0.5, 1.0) for r in rows)


def test_recall_probe_batches_ask_for_a_value_in_context():
    from eval.recall_probe import MASK, recall_batch, train_recall

    tokens, answers = recall_batch(jax.random.key(0), pairs=3, batch=32)
    assert tokens.shape == (32, 8) and bool(jnp.all(tokens[:, -1] == MASK))
    for row, answer in zip(np.asarray(tokens), np.asarray(answers)):
        keys, values = row[:6:2], row[1:6:2]
        assert len(set(keys)) == 3 and values[list(keys).index(row[-2])] == answer
    assert len(train_recall("rope", pairs=2, steps=200, batch=8, report=lambda _: None)) == 1


def test_recall_probe_aux_rows_mask_one_fixed_value():
    from eval.recall_probe import FILLER, FIXED_VALUE, MASK, aux_rows, recall_batch, train_recall

    recall, _ = recall_batch(jax.random.key(0), pairs=3, batch=32, gap=2)
    assert recall.shape == (32, 10) and bool(jnp.all(recall[:, 7:9] == jnp.array([FILLER, FILLER + 1])))
    tokens, column, values, query_values = aux_rows(recall, jax.random.key(1), pairs=3)
    assert tokens.shape == (32, 10) and set(np.asarray(column) % 2) == {1}
    for row, source, col, value, query_value in zip(*map(np.asarray, (tokens, recall, column, values, query_values))):
        assert row[col] == MASK and (row[:6] == MASK).sum() == 1 and value == FIXED_VALUE[row[col - 1]]
        assert all(row[i + 1] == FIXED_VALUE[row[i]] for i in range(0, 6, 2) if i + 1 != col)
        assert list(row[::2][:3]) == list(source[::2][:3]) and list(row[6:]) == list(source[6:])  # keys, tail kept
        assert query_value == FIXED_VALUE[row[6]]
    assert len(train_recall("ours", pairs=2, steps=200, batch=8, aux=0.5, gap=1, report=lambda _: None)) == 1


def test_recall_probe_curriculum_runs_its_stages_in_turn():
    from eval.recall_probe import train_recall

    lines = []
    curve = train_recall("abs", pairs=[2, 3], steps=[200, 200], batch=4, report=lines.append)
    assert len(curve) == 2 and [l.split(" step")[0] for l in lines] == ["abs pairs 2", "abs pairs 3"]
    with pytest.raises(ValueError, match="one step count per stage"):
        train_recall("abs", pairs=[2, 3], steps=[200], report=lambda _: None)


def test_mixture_from_the_command_line():
    from eval.train import parse_mixture

    assert parse_mixture("babi,routine", "0.45,0.15", 0) == Mixture(("babi", "routine"), (0.45, 0.15), 0)
    assert parse_mixture("babi,routine", None, 2).weights == (0.6, 1.0)  # the default mixture's, else 1
    with pytest.raises(ValueError, match="one weight per known task"):
        parse_mixture("babi,routine", "0.5", 2)


def test_bench_train_times_every_setting(capsys):
    from eval.bench_train import main

    assert main(["--batch", "2", "--seq-len", "128", "--steps", "1", "--attn", "xla",
                 "--pretrain-fraction", "0.5", "--embed", "one-hot,take"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("attn xla")]
    assert [l.split(":")[0] for l in lines] == [f"attn xla, pretrain fraction 0.5, embedding {e}"
                                                for e in ("one-hot", "take")]
    assert all(float(l.split("then ")[1].split()[0]) > 0 for l in lines)

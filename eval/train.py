"""Train a small LLaDA- or Dream-architecture diffusion model on the task mixture, then export it.

python -m eval.train --family llada|dream --out DIR [--steps N --batch B --seed S --tiny --plot]
python -m eval.train --family llada|dream --out DIR --init MODEL_DIR ...   # fine-tune an exported model

Objective (masked diffusion, LLaDA's SFT form mixed with its pretraining form): per sequence a mask
ratio t ~ U(eps, 1), drawn stratified over the batch to lower the variance; in SFT rows every token
of the generation region (answer + END padding) is masked with probability t and the prompt and
affixes stay visible; in pretraining rows (a `pretrain_fraction` of them) every real token after
the first may be masked. Loss per row = cross-entropy on the masked tokens weighted 1/t, divided by
the maskable region's size; then the mean over rows. Dream predicts token i
from position i-1: the model applies that shift itself, so for both families the loss reads the
logits at the masked token's own index.

DIR receives the model in its family's HF layout (config.json, model.safetensors, tokenizer files),
run.json (the settings), losses.json, loss.png (--plot) and eval.json (--eval-n); orbax checkpoints
go to DIR/checkpoints (or --ckpt-dir), and a run restarted with the same settings resumes from the
latest one and continues exactly as if uninterrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from acache_jax import compile_cache
from acache_jax.decoding.layout import round_up
from acache_jax.network.config import DecodeConfig, ModelConfig
from acache_jax.network.files import write_atomic
from acache_jax.network.hf_checkpoint import export_hf
from acache_jax.network.model import ForwardInputs, Transformer
from eval.tasks import STUDY_TASKS
from eval.tasks.layouts import GEN_LENGTH
from eval.tokenizer import build_tokenizer, save_tokenizer, special_ids
from eval.train_data import Mixture, Pool, build_pool

# head_dim 64 everywhere (the GPU kernel's); bf16 exports of about 9.3 MB (llada) and 9.7 MB (dream).
SIZES = {
    "llada": dict(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=4, intermediate_size=640),
    "dream": dict(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=768),
}
TINY = {  # CPU runs: one 64-wide head per layer, 0.2M parameters
    family: dict(hidden_size=64, num_layers=4, num_heads=1, num_kv_heads=1, intermediate_size=128)
    for family in ("llada", "dream")
}
FAMILY = {  # upstream values of each family
    "llada": dict(rope_theta=500000.0, rms_norm_eps=1e-5, qkv_bias=False),
    "dream": dict(rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True),
}
MAX_SEQ_LEN = 512


def model_config(family: str, vocab_size: int, ids: dict[str, int], tiny: bool = False) -> ModelConfig:
    size = (TINY if tiny else SIZES)[family]
    cfg = ModelConfig(family=family, vocab_size=round_up(vocab_size, 64), head_dim=64, max_seq_len=MAX_SEQ_LEN,
                      **size, **FAMILY[family], **ids)
    cfg.validate()
    return cfg


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Optimisation settings (hashable: a static argument of the jitted step)."""

    steps: int = 4000
    batch: int = 512
    lr: float = 1e-3
    warmup: int | None = None  # linear warmup steps (default: 5% of the steps)
    weight_decay: float = 0.1
    mask_eps: float = 1e-3
    pretrain_fraction: float = 0.5  # rows whose prompt is masked too: dense copy signal, so retrieval is learned
    shared_embedding: float = 1.0  # scale of one random direction added to every token's initial embedding
    gen_length: int = GEN_LENGTH
    compute_dtype: str = "bfloat16"
    attn_backend: str = "xla"
    one_hot_embed: bool = True  # the lookup's scatter-add gradient made the GPU step 7x slower (docs/BENCHMARKS.md)

    @property
    def warmup_steps(self) -> int:
        warmup = self.steps // 20 if self.warmup is None else self.warmup
        if not 0 <= warmup < self.steps:
            raise ValueError(f"warmup ({warmup}) must be shorter than the run ({self.steps} steps)")
        return warmup


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: nnx.State  # float32 master weights
    opt_state: Any
    step: jax.Array  # [] int32


def optimizer(recipe: Recipe) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay to a tenth; no weight decay on norms and biases."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, recipe.lr, recipe.warmup_steps, recipe.steps, recipe.lr / 10)
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=recipe.weight_decay, mask=matrices))


def initial_model(cfg: ModelConfig, recipe: Recipe, seed: int) -> Transformer:
    """The random network a run starts from. Every token embedding gets one shared random direction:
    it gives queries and keys a part that does not depend on the token, so a RoPE head can attend by
    relative position (the previous name, the place after it) from the first step. Without it no
    model got past answering bAbI with the last-mentioned place (docs/TRAINING.md)."""
    model = Transformer(cfg, jnp.float32, rngs=nnx.Rngs(seed))
    shared = jax.random.normal(jax.random.key(seed + 1), (cfg.hidden_size,), jnp.float32)
    model.embed[...] = model.embed[...] + recipe.shared_embedding * shared
    return model


def starting_point(cfg: ModelConfig, recipe: Recipe, seed: int,
                   init: str | Path | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, float32 params) of a fresh network, or of the exported model in `init` (fine-tuning)."""
    if init is None:
        return nnx.split(initial_model(cfg, recipe, seed))
    from acache_jax.network.checkpoint import load

    model = load(init, "float32")
    if model.config != cfg:
        raise ValueError(f"{init} holds another architecture than this run's: {model.config} vs {cfg}")
    return model.graphdef, model.params


def corrupt(tokens: jax.Array, gen_start: jax.Array, length: jax.Array, key: jax.Array, mask_id: int,
            recipe: Recipe) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The forward process: (noisy tokens [B, T], maskable region [B, T], masked [B, T], mask ratio [B]).

    The region is the generation region (SFT rows) or, for a `pretrain_fraction` of the rows, every
    real token after the first (pretraining rows: the prompt and affixes are masked too).
    """
    b, t = tokens.shape
    ratio_key, mask_key, row_key = jax.random.split(key, 3)
    ratio = (jax.random.uniform(ratio_key) + jnp.arange(b) / b) % 1.0  # one draw, spread evenly over [0, 1)
    ratio = recipe.mask_eps + (1 - recipe.mask_eps) * ratio
    pos = jnp.arange(t)[None]
    generation = (pos >= gen_start[:, None]) & (pos < gen_start[:, None] + recipe.gen_length)
    pretrain = jax.random.uniform(row_key, (b, 1)) < recipe.pretrain_fraction
    region = jnp.where(pretrain, (pos >= 1) & (pos < length[:, None]), generation)
    masked = region & (jax.random.uniform(mask_key, (b, t)) < ratio[:, None])
    return jnp.where(masked, mask_id, tokens), region, masked, ratio


def one_hot_embeddings(table: jax.Array, ids: jax.Array) -> jax.Array:
    """The rows of `table` [V, D] for `ids` as a one-hot matmul: the lookup's values, but a matmul
    for a gradient, where the lookup's is a scatter-add that serialises on repeated ids such as the
    mask id (a 7x slower training step on an H200). For small vocabularies only: [*ids.shape, V]."""
    return jax.nn.one_hot(ids, table.shape[0], dtype=table.dtype) @ table


def diffusion_loss(params: nnx.State, graphdef: nnx.GraphDef, tokens: jax.Array, gen_start: jax.Array,
                   length: jax.Array, key: jax.Array, mask_id: int, recipe: Recipe) -> jax.Array:
    """Masked-diffusion loss of a batch: tokens [B, T] int32 (right-padded), gen_start / length [B] int32.
    Per row: the sum over masked tokens of CE / t, divided by the region's size; then the batch mean."""
    b, t = tokens.shape
    noisy, region, masked, ratio = corrupt(tokens, gen_start, length, key, mask_id, recipe)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    compute = jax.tree.map(lambda p: p.astype(recipe.compute_dtype), params)
    network = nnx.merge(graphdef, compute)  # the module itself: training passes its own embeddings
    embeddings = one_hot_embeddings(network.embed[...], noisy) if recipe.one_hot_embed else None
    logits = network(noisy, ForwardInputs(positions, positions < length[:, None]), attn_backend=recipe.attn_backend,
                     embeddings=embeddings).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    per_row = jnp.sum(jnp.where(masked, ce / ratio[:, None], 0.0), axis=1) / jnp.sum(region, axis=1)
    return jnp.mean(per_row)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=3)
def train_step(graphdef: nnx.GraphDef, recipe: Recipe, mask_id: int, state: TrainState, pool: Pool,
               key: jax.Array) -> tuple[TrainState, jax.Array]:
    """One optimiser step on a batch drawn from the device-resident pool; the step's randomness is
    fold_in(key, step), so a resumed run draws what an uninterrupted one would."""
    batch_key, loss_key = jax.random.split(jax.random.fold_in(key, state.step))
    rows = jax.random.randint(batch_key, (recipe.batch,), 0, pool.tokens.shape[0])
    loss, grads = jax.value_and_grad(diffusion_loss)(
        state.params, graphdef, pool.tokens[rows].astype(jnp.int32), pool.gen_start[rows], pool.length[rows],
        loss_key, mask_id, recipe)
    updates, opt_state = optimizer(recipe).update(grads, state.opt_state, state.params)
    return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), loss


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1))


def _settings(out: Path, settings: dict) -> None:
    """Record the run's settings; refuse to resume a run made with others."""
    path = out / "run.json"
    settings = json.loads(json.dumps(settings))  # as read back: tuples become lists
    if path.is_file():
        before = json.loads(path.read_text())
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            raise SystemExit(f"error: {out} holds a run with other settings (was, now): {changed}; "
                             "use another --out or the same settings")
    _write_json(path, settings)


def train(family: str, out: str | Path, recipe: Recipe = Recipe(), *, seed: int = 0, tiny: bool = False,
          mixture: Mixture = Mixture(), seq_len: int = 320, pool_size: int | None = None, workers: int = 1,
          ckpt_dir: str | Path | None = None, ckpt_every: int = 500, log_every: int = 50,
          progress: bool = True, max_seconds: float | None = None,
          init: str | Path | None = None) -> tuple[ModelConfig, nnx.State]:
    """Train (or resume) and export into `out`; returns the config and the float32 parameters.

    init: start from this exported model's weights (same family and size) instead of a random
    network; the optimiser and its schedule start afresh.

    max_seconds: stop early once the loop has run this long (checkpoint and export what there is;
    the same command resumes), so a run on a lent machine always leaves a model behind.
    """
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pool_size = pool_size or min(recipe.steps * recipe.batch, 1 << 20)
    _settings(out, {"family": family, "recipe": dataclasses.asdict(recipe), "seed": seed, "tiny": tiny,
                    "mixture": dataclasses.asdict(mixture), "seq_len": seq_len, "pool_size": pool_size,
                    "init": None if init is None else str(init)})
    tokenizer = build_tokenizer()
    save_tokenizer(tokenizer, out)
    ids = special_ids(tokenizer)
    cfg = model_config(family, tokenizer.get_vocab_size(), ids, tiny)
    start_time = time.perf_counter()
    pool = jax.device_put(build_pool(tokenizer, pool_size, seq_len, seed, mixture, ids["eos_token_id"],
                                     ids["pad_token_id"], workers))
    print(f"{family}: {cfg.num_params / 1e6:.2f}M parameters; pool of {pool_size} sequences x {seq_len} tokens "
          f"built in {time.perf_counter() - start_time:.0f}s", file=sys.stderr)

    graphdef, params = starting_point(cfg, recipe, seed, init)
    state = TrainState(params, optimizer(recipe).init(params), jnp.int32(0))
    manager = ocp.CheckpointManager(Path(ckpt_dir or out / "checkpoints").absolute(),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))
    losses_path = out / "losses.json"
    losses: list[float] = []
    if manager.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, vars(state))
        state = TrainState(**manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract)))
        losses = json.loads(losses_path.read_text())["loss"][:int(state.step)] if losses_path.is_file() else []
    key = jax.random.key(seed)
    start = int(state.step)
    pending = []
    bar = tqdm(range(start, recipe.steps), initial=start, total=recipe.steps, desc=f"training {family}",
               disable=not progress, mininterval=2.0)
    clock = time.perf_counter()
    for step in bar:
        state, loss = train_step(graphdef, recipe, cfg.mask_token_id, state, pool, key)
        pending.append(loss)
        done = step + 1
        out_of_time = max_seconds is not None and time.perf_counter() - clock > max_seconds
        checkpoint = done % ckpt_every == 0 or done == recipe.steps or out_of_time
        if done % log_every == 0 or checkpoint:
            losses += [float(x) for x in jax.device_get(pending)]  # the only host sync of the loop
            pending = []
            bar.set_postfix(loss=f"{sum(losses[-log_every:]) / len(losses[-log_every:]):.4f}")
        if checkpoint:
            manager.save(done, args=ocp.args.StandardSave(vars(state)))
            _write_json(losses_path, {"step": list(range(1, len(losses) + 1)), "loss": losses})
        if out_of_time:
            print(f"stopped at step {done} of {recipe.steps}: {max_seconds:.0f}s reached (the same command resumes)",
                  file=sys.stderr)
            break
    manager.wait_until_finished()
    seconds = time.perf_counter() - clock
    if len(losses) > start:
        print(f"{len(losses) - start} steps in {seconds:.1f}s ({(len(losses) - start) / seconds:.2f} steps/s, "
              f"compilation included)", file=sys.stderr)
    export_hf(out, cfg, state.params, generation=DecodeConfig(gen_length=recipe.gen_length,
                                                              block_length=recipe.gen_length))
    return cfg, state.params


def parse_mixture(tasks: str, weights: str | None, max_shots: int) -> Mixture:
    """The mixture of comma-separated task names and weights (default: Mixture's, 1 for other tasks)."""
    names = tuple(tasks.split(","))
    defaults = dict(zip(Mixture.tasks, Mixture.weights))
    values = tuple(float(w) for w in weights.split(",")) if weights else tuple(defaults.get(t, 1.0) for t in names)
    return Mixture(names, values, max_shots)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.train", description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(SIZES), required=True)
    p.add_argument("--out", type=Path, required=True, help="output directory (the exported HF model and logs)")
    p.add_argument("--steps", type=int, default=Recipe.steps)
    p.add_argument("--batch", type=int, default=Recipe.batch)
    p.add_argument("--lr", type=float, default=Recipe.lr)
    p.add_argument("--warmup", type=int, help="warmup steps (default: 5%% of --steps)")
    p.add_argument("--pretrain-fraction", type=float, default=Recipe.pretrain_fraction,
                   help="share of sequences whose prompt is masked too (pretraining rows)")
    p.add_argument("--shared-embedding", type=float, default=Recipe.shared_embedding,
                   help="scale of the random direction shared by every initial token embedding (0: plain init)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a small model for CPU smoke runs")
    p.add_argument("--init", type=Path, help="fine-tune: start from this exported model (same --family and size)")
    p.add_argument("--tasks", default=",".join(Mixture.tasks), help="comma-separated training tasks")
    p.add_argument("--weights", help="comma-separated sampling weights, one per task (default: "
                   f"{dict(zip(Mixture.tasks, Mixture.weights))}, 1 for other tasks)")
    p.add_argument("--max-shots", type=int, default=Mixture.max_shots, help="most few-shot examples in training")
    p.add_argument("--seq-len", type=int, default=320, help="training sequence length (longer samples are redrawn)")
    p.add_argument("--pool", type=int, help="distinct training sequences (default: steps x batch, at most 2^20)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="processes that build the pool")
    p.add_argument("--compute-dtype", choices=["bfloat16", "float32"],
                   help="matmul dtype (default: bfloat16 on GPU, float32 on CPU); weights stay float32")
    p.add_argument("--attn", choices=["xla", "cudnn"], default="xla", help="attention backend")
    p.add_argument("--ckpt-dir", type=Path, help="orbax checkpoints (default: OUT/checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--max-seconds", type=float, help="stop (checkpoint + export) after this long; rerun to resume")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--plot", action="store_true", help="write OUT/loss.png (needs matplotlib; or later: "
                   "python -m eval.plot_losses OUT/losses.json)")
    p.add_argument("--eval-n", type=int, default=0, help="held-out questions per setting to score after training")
    p.add_argument("--eval-tasks", default=",".join(STUDY_TASKS))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    compile_cache.enable()  # compiled programs are kept for later runs (acache_jax/compile_cache.py)
    mixture = parse_mixture(args.tasks, args.weights, args.max_shots)
    dtype = args.compute_dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32")
    recipe = Recipe(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, compute_dtype=dtype,
                    pretrain_fraction=args.pretrain_fraction, shared_embedding=args.shared_embedding,
                    attn_backend=args.attn)
    train(args.family, args.out, recipe, seed=args.seed, tiny=args.tiny, mixture=mixture, seq_len=args.seq_len,
          pool_size=args.pool, workers=args.workers, ckpt_dir=args.ckpt_dir, ckpt_every=args.ckpt_every,
          log_every=args.log_every, max_seconds=args.max_seconds, init=args.init)
    if args.plot:
        from eval.plot_losses import plot_losses

        plot_losses(args.out / "losses.json", args.out / "loss.png")
    if args.eval_n:
        from acache_jax.network.checkpoint import load
        from eval.accuracy import grid

        rows = grid(load(args.out), args.eval_tasks.split(","), args.eval_n)
        _write_json(args.out / "eval.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

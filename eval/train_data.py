"""Training sequences: a seeded mixture of the tasks in every layout, encoded once into a pool.

Each sequence is laid out as `acache_jax.decoding.layout` lays out a request at inference (prompt and any
prefix/infix affix, the generation region, then any suffix affix), with the answer and END padding
in the generation region, right-padded to the pool's length. The pool depends only on the seed and
its size (chunks are seeded by index), not on the number of worker processes.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import jax
import numpy as np
from tokenizers import Tokenizer

from eval.tasks import TASKS
from eval.tasks.layouts import GEN_LENGTH, PLACEMENTS, affix_ids, encoder, request, target_ids

CHUNK = 1024
REDRAWS = 100  # a mixture whose samples keep exceeding seq_len is an error, not a slow loop
_TRAIN_STREAM = 0  # evaluation draws from stream 1 (eval.tasks.eval_split)


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Which tasks, how often, and up to how many few-shot examples (placed uniformly at random)."""

    tasks: tuple[str, ...] = ("babi", "arithmetic", "codebook")
    weights: tuple[float, ...] = (0.6, 0.2, 0.2)
    max_shots: int = 2
    gen_length: int = GEN_LENGTH

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or len(self.weights) != len(self.tasks):
            raise ValueError(f"mixture needs one weight per known task; tasks {self.tasks}, weights {self.weights}, "
                             f"known {sorted(TASKS)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pool:
    tokens: np.ndarray  # [N, T] int16, pad id after each sequence's end
    gen_start: np.ndarray  # [N] int32 column of the generation region
    length: np.ndarray  # [N] int32 real tokens


def sample(rng: np.random.Generator, mixture: Mixture, encode, eos_id: int) -> tuple[list[int], int]:
    """(token ids, generation start) of one training sequence: a task, 0..max_shots examples
    (at least one where the task needs them) and a placement for them."""
    task = TASKS[mixture.tasks[rng.choice(len(mixture.tasks), p=np.asarray(mixture.weights) / sum(mixture.weights))]]
    shots = int(rng.integers(1 if task.needs_affix else 0, mixture.max_shots + 1))
    placement = "none" if shots == 0 else PLACEMENTS[int(rng.integers(1, len(PLACEMENTS)))]
    *examples, example = task.generate(rng, shots + 1)
    target = target_ids(encode, example, eos_id, mixture.gen_length)
    row = request(encode, example, placement).row(affix_ids(encode, examples, placement) or [], len(target), 0)
    tokens = row.tokens.tolist()
    tokens[row.gen_start:row.gen_start + len(target)] = target
    return tokens, row.gen_start


def _chunk(tokenizer_json: str, mixture: Mixture, seed: int, index: int, count: int, seq_len: int,
           ids: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    eos_id, pad_id = ids
    encode = encoder(Tokenizer.from_str(tokenizer_json))
    rng = np.random.default_rng([seed, _TRAIN_STREAM, index])
    tokens = np.full((count, seq_len), pad_id, np.int16)
    gen_start, length = np.zeros(count, np.int32), np.zeros(count, np.int32)
    for i in range(count):
        for _ in range(REDRAWS):  # rare worst cases (the longest stories in every slot) are drawn again
            seq, start = sample(rng, mixture, encode, eos_id)
            if len(seq) <= seq_len:
                break
        else:
            raise ValueError(f"seq_len {seq_len} is too short for this mixture: {REDRAWS} draws in a row were longer")
        tokens[i, :len(seq)], gen_start[i], length[i] = seq, start, len(seq)
    return tokens, gen_start, length


def build_pool(tokenizer: Tokenizer, n: int, seq_len: int, seed: int, mixture: Mixture, eos_id: int, pad_id: int,
               workers: int = 1) -> Pool:
    """n sequences of length seq_len, generated in chunks of CHUNK over `workers` processes."""
    jobs = [(tokenizer.to_str(), mixture, seed, i, min(CHUNK, n - start), seq_len, (eos_id, pad_id))
            for i, start in enumerate(range(0, n, CHUNK))]
    if workers <= 1:
        parts = [_chunk(*job) for job in jobs]
    else:  # spawn: the parent may already run JAX threads, which fork would copy mid-flight
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
            parts = list(ex.map(_chunk, *zip(*jobs)))
    return Pool(*(np.concatenate(arrays) for arrays in zip(*parts)))

"""Early stop: a request whose finished block is all end-of-text gets the rest as end-of-text
without computing it. On the shipped model (trained for 32-token answers) the later blocks are
end-of-text anyway, so the tokens are those of computing every block, with fewer forwards."""

from pathlib import Path

import pytest

import acache_jax
from acache_jax import Engine, Request
from acache_jax.decoding.decode import generate

MODEL = Path(acache_jax.__file__).resolve().parent / "models" / "llada-small"
QUESTIONS = ["Story: Mary moved to the bathroom. John went to the hallway. Mary travelled to the garden. "
             "Question: Where is Mary? Answer with one location:",
             "Question: Sam has 12 pencils. Then he finds 5 more. Then he loses 3. How many pencils does Sam "
             "have now? Let's think step by step. Answer:"]


@pytest.fixture(scope="module")
def model():
    return acache_jax.load(MODEL)


def test_early_stop_keeps_the_tokens_and_saves_forwards(model):
    prompts = [model.encode(q) for q in QUESTIONS]
    every = generate(model, prompts, model.decode_config(gen_length=128, early_stop=False))
    early = generate(model, prompts, model.decode_config(gen_length=128))
    assert [t.tolist() for t in early.tokens] == [t.tolist() for t in every.tokens]
    assert [model.answer_text(t) for t in early.tokens] == ["garden", "12 + 5 = 17. 17 - 3 = 14. The answer is 14"]
    assert (early.nfe < every.nfe).all() and (early.forward_tokens < every.forward_tokens).all()
    assert every.nfe.tolist() == [4, 4] and early.nfe.tolist() == [2, 2]  # blocks 2 and 3 never computed
    served = Engine(model, model.decode_config(gen_length=128), pool_tokens=4096).generate(
        [Request(p) for p in prompts])
    assert [r.tokens.tolist() for r in served] == [t.tolist() for t in early.tokens]
    assert [r.nfe for r in served] == early.nfe.tolist()

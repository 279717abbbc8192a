"""acache_jax.lm_eval run by lm-eval itself on local task files (written like `python -m
eval.lm_eval_data` writes them): the command line, generation that answers what eval.accuracy's
does, the loglikelihood estimate, affix mode against eval.affix_sweep, and bad model args."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # no hub: read before lm-eval imports datasets
for _key, _value in OFFLINE.items():
    os.environ.setdefault(_key, _value)
import lm_eval  # noqa: E402 (the test extra installs it)
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import acache_jax  # noqa: E402
from acache_jax.decoding.decode import generate  # noqa: E402
from acache_jax.lm_eval import ACacheLM, likelihood  # noqa: E402
from acache_jax.network.config import InputError  # noqa: E402
from eval import lm_eval_data  # noqa: E402
from eval.accuracy import accuracy, full_recompute  # noqa: E402
from eval.affix_sweep import Grid  # noqa: E402
from eval.tasks import eval_split, get_task  # noqa: E402
from eval.tasks.layouts import affix_ids, encoder, request  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "acache_jax" / "models" / "llada-small"
TASKS = ROOT / "eval" / "lm_eval_tasks"
N = 16  # questions per task (arithmetic: 2 N)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The tasks' local files, found through the variable the task YAMLs read."""
    out = tmp_path_factory.mktemp("lm_eval_data")
    lm_eval_data.write(out, ["babi", "codebook"], N)
    lm_eval_data.write(out, ["arithmetic"], 2 * N)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACACHE_LM_EVAL_DATA", str(out))
        yield out


@pytest.fixture(scope="module")
def model():
    return acache_jax.load(MODEL)


@pytest.fixture(scope="module")
def manager(data) -> TaskManager:
    return TaskManager(include_path=str(TASKS), include_defaults=False)  # lm-eval's own tasks: not needed here


def evaluate(manager, task: str, **model_args) -> tuple[float, list[str]]:
    """(accuracy, the answer to each document in order) of one lm-eval run."""
    lm = ACacheLM(batch_size=N, include_path=str(TASKS), **model_args)
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True, verbosity="ERROR")
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return out["results"][task]["acc,none"], [s["filtered_resps"][0] for s in samples]


def eval_answers(model, task: str, placement: str, shots: int, n: int, config=None) -> list[str]:
    """The answers eval.accuracy scores (same requests, same affix)."""
    encode = encoder(model.tokenizer)
    examples, questions = eval_split(get_task(task), 0, n)
    ids = affix_ids(encode, examples[:shots], placement)
    out = generate(model, [request(encode, q, placement, seed=i) for i, q in enumerate(questions)],
                   config or full_recompute(model), affix=ids, max_batch=256)
    return [model.answer_text(t) for t in out.tokens]


def test_the_command_line_runs_both_kinds_of_task(data, model, tmp_path):
    """python -m acache_jax.lm_eval as a user runs it: a generation task that answers exactly what
    eval.accuracy answers on the same questions, and a multiple-choice task well above chance."""
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, "-m", "acache_jax.lm_eval", "--model", "acache_jax", "--model_args",
         f"pretrained={MODEL.relative_to(ROOT)},mc_num=1", "--tasks", "acache_arithmetic,acache_babi_choice",
         "--include_path", str(TASKS.relative_to(ROOT)), "--batch_size", str(N), "--output_path", str(out),
         "--log_samples"], cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **OFFLINE})
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    lines = next(out.rglob("samples_acache_arithmetic_*.jsonl")).read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    answers = [s["filtered_resps"][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
    assert answers == eval_answers(model, "arithmetic", "none", 0, 2 * N)
    assert results["acache_arithmetic"]["acc,none"] == accuracy(model, "arithmetic", "none", 0, 2 * N)
    assert results["acache_babi_choice"]["acc,none"] >= 0.75  # 8 locations: chance is 0.125


def test_lm_eval_indexes_its_own_tasks_only_when_one_is_asked_for(manager):
    """`--include_path` holding every task of `--tasks`: lm-eval's catalogue (some 15,000 task
    configs, 9 s on a CPU) is not indexed; any other task name, or no --include_path, indexes it."""
    import lm_eval.tasks

    from acache_jax.lm_eval import _only_included_tasks, _without_lm_eval_catalogue, parser

    parse = lambda *argv: parser().parse_known_args(["--model", "acache_jax", *argv])[0]
    assert _only_included_tasks(parse("--tasks", "acache_codebook,acache_babi", "--include_path", str(TASKS)))
    assert _only_included_tasks(parse("--tasks", "acache_codebook", "acache_babi", "--include_path", str(TASKS)))
    assert not _only_included_tasks(parse("--tasks", "acache_codebook,hellaswag", "--include_path", str(TASKS)))
    assert not _only_included_tasks(parse("--tasks", "acache_codebook"))
    assert lm_eval.api.registry.get_model("local-chat-completions")  # lm-eval's own models stay registered
    with _without_lm_eval_catalogue():
        assert sorted(lm_eval.tasks.TaskManager(include_path=str(TASKS)).all_tasks) == sorted(manager.all_tasks)
    assert lm_eval.tasks.TaskManager is TaskManager


@pytest.mark.parametrize("ratio", [0.0, 0.2, 1.0])
def test_affix_mode_scores_what_the_affix_sweep_does(manager, model, ratio):
    """The codebook task (answers only in the few-shot examples), 1-shot prefix affix, anchor ratio r:
    lm-eval's accuracy and answers are eval.affix_sweep's on the same questions."""
    overrides = Grid((ratio,)).settings()[f"acache@{ratio:g}"]
    acc, answers = evaluate(manager, "acache_codebook", affix_mode="prefix", num_fewshot_affix=1, **overrides)
    config = dataclasses.replace(full_recompute(model), **overrides)
    assert answers == eval_answers(model, "codebook", "prefix", 1, N, config)
    assert acc == accuracy(model, "codebook", "prefix", 1, N, 0, config)


def _instances(manager, task: str, gen_kwargs: dict | None = None) -> list[Instance]:
    """lm-eval's generate_until instances of a task's documents, as lm-eval builds them."""
    docs = list(manager.load([task])["tasks"][task].test_docs())
    kwargs = gen_kwargs or {"until": [], "max_gen_toks": 32}
    return [Instance("generate_until", doc, (doc["query"], dict(kwargs)), 0, (task, i, 1))
            for i, doc in enumerate(docs)]


@pytest.mark.parametrize("placement", ["prefix", "infix", "suffix"])
def test_affix_layouts_are_the_papers_from_document_fields(manager, model, placement):
    """Every placement: the affix and each request hold exactly the tokens eval.affix_sweep decodes."""
    lm = ACacheLM(include_path=str(TASKS), affix_mode=placement, num_fewshot_affix=2)
    encode = encoder(model.tokenizer)
    examples, questions = eval_split(get_task("codebook"), 0, N)
    assert lm.affix("acache_codebook").ids == affix_ids(encode, examples[:2], placement)
    for i, (inst, question) in enumerate(zip(_instances(manager, "acache_codebook"), questions, strict=True)):
        assert lm.request(inst) == request(encode, question, placement, seed=i)
    drawn = ACacheLM(include_path=str(TASKS), affix_mode=placement, num_fewshot_affix=1, fewshot_seed=3)
    pick = np.random.default_rng(3).choice(2, 1, replace=False)[0]
    assert drawn.affix("acache_codebook").ids == affix_ids(encode, [examples[pick]], placement)
    doc = _instances(manager, "acache_codebook")[0].doc
    with_shots = Instance("generate_until", doc, ("Decode: zib\nzib means purple.\n\n" + doc["query"], {}), 0,
                          ("acache_codebook", 0, 1))  # what lm-eval renders with --num_fewshot 1
    with pytest.raises(InputError, match="--num_fewshot 0"):
        lm.request(with_shots)


def test_generation_stops_at_until_and_max_gen_toks(manager, model):
    """The text is cut at the first `until` string and after max_gen_toks tokens (the generation
    itself runs a whole block)."""
    lm = ACacheLM(batch_size=2 * N)
    instances = _instances(manager, "acache_arithmetic")
    for n, inst in enumerate(instances):
        inst.arguments = (inst.args[0], {"until": ["The answer"]} if n % 2 else {"until": [], "max_gen_toks": 3})
    whole = eval_answers(model, "arithmetic", "none", 0, 2 * N)
    cut = [w.split("The answer")[0] if n % 2 else model.tokenizer.decode(model.tokenizer(w)["input_ids"][:3])
           for n, w in enumerate(whole)]
    assert lm.generate_until(instances) == cut and all(w.startswith(c) and w != c for w, c in zip(whole, cut))


def test_the_engine_answers_like_the_static_path(manager, model):
    lm = ACacheLM(batch_size=N, engine=True, include_path=str(TASKS), affix_mode="prefix", num_fewshot_affix=1,
                  cache="acache", anchor_ratio=0.2)
    answers = lm.generate_until(_instances(manager, "acache_codebook"))
    config = model.decode_config(cache="dual").replace(cache="acache", anchor_ratio=0.2)
    assert answers == eval_answers(model, "codebook", "prefix", 1, N, config)


def _published(root: Path) -> None:
    """Tiny files in the published formats of GSM8K, MBPP and BABILong-0k/qa1."""
    def write(path: Path, records: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    gsm = lambda a, b: {"question": f"Tom has {a} apples and buys {b} more. How many does he have?",
                        "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
    write(root / "gsm8k" / "test.jsonl", [gsm(3, 4), gsm(10, 5)])
    write(root / "gsm8k" / "train.jsonl", [gsm(1, 1)])
    mbpp = lambda task_id: {"task_id": task_id, "text": "Write a function to add two numbers.",
                            "code": "def add(a, b):\n    return a + b", "test_setup_code": "",
                            "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
                            "challenge_test_list": []}
    write(root / "mbpp" / "mbpp.jsonl", [mbpp(2), mbpp(11), mbpp(600)])
    write(root / "babilong" / "0k" / "qa1.jsonl", [
        {"input": "Mary moved to the bathroom. John went to the hallway.", "question": "Where is Mary?",
         "target": "bathroom"},
        {"input": "Daniel went back to the garden.", "question": "Where is Daniel?", "target": "garden"}])


@pytest.mark.parametrize("task, good, bad", [
    ("acache_gsm8k", "3 + 4 = 7.\nThe answer is 7", "The answer is 8"),
    ("acache_mbpp", "def add(a, b):\n    return a + b\n[DONE]", "def add(a, b):\n    return a - b"),
    ("acache_babilong_qa1", "bathroom", "hallway"),
])
def test_published_formats_become_the_papers_documents(tmp_path, monkeypatch, task, good, bad):
    """GSM8K, MBPP and BABILong files as published: the paper's query and few-shot answer in each
    document (eval.tasks.loaders'), scored by the paper's answer extraction, usable in affix mode."""
    from eval.tasks.loaders import LOADERS

    _published(tmp_path)
    monkeypatch.setenv("ACACHE_LM_EVAL_DATA", str(tmp_path))
    loaded = TaskManager(include_path=str(TASKS), include_defaults=False).load([task])["tasks"][task]
    docs, shots = list(loaded.test_docs()), list(loaded.fewshot_docs())
    source = {"acache_gsm8k": "gsm8k/test.jsonl", "acache_mbpp": "mbpp/mbpp.jsonl",
              "acache_babilong_qa1": "babilong/0k/qa1.jsonl"}
    first = LOADERS[task.split("_")[1]](tmp_path / source[task])[1 if task == "acache_mbpp" else 0]
    assert docs[0]["query"] == first.prompt.query(first.question) and docs[0]["answer_prompt"] == first.prompt.back
    assert len(docs) == (1 if task == "acache_mbpp" else 2) and shots[0]["shot_answer"]
    assert loaded.process_results(docs[0], [good]) == {"acc": 1.0}
    assert loaded.process_results(docs[0], [bad]) == {"acc": 0.0}
    lm = ACacheLM(include_path=str(TASKS), affix_mode="infix", num_fewshot_affix=1)
    inst = Instance("generate_until", docs[0], (docs[0]["query"], {}), 0, (task, 0, 1))
    assert lm.request(inst).tail and lm.affix(task).text.startswith("Example 1:\n" + shots[0]["query"])


@pytest.mark.parametrize("name", ["llada-small", "dream-small"])
def test_a_one_token_continuation_scores_its_masked_cross_entropy(name):
    """With L = 1 every sample masks the one token (weight 1): the estimate is log p of it at the
    mask, as the model's logits give it (Dream's shift included)."""
    model = acache_jax.load(MODEL.parent / name, dtype="float32")  # bf16 rounds with the padded shape
    encode = encoder(model.tokenizer)
    prompt = encode("<|user|> Story:\nMary went to the garden.\nQuestion: Where is Mary?\nAnswer with one location:\n"
                    "<|assistant|>")
    places = ["garden", "kitchen", "office"]
    got = likelihood.loglikelihood(model, [(prompt, encode(p)) for p in places], mc_num=4, group=2, rows=4)
    masked = np.asarray([prompt + [model.config.mask_token_id]])
    logp = np.asarray(jax.nn.log_softmax(model.logits(masked)[0, -1]))
    np.testing.assert_allclose(got, [logp[encode(p)[0]] for p in places], rtol=1e-5, atol=1e-5)
    assert np.argmax(got) == 0


def test_the_estimate_is_stratified_seeded_and_independent_of_batching(model):
    rng = np.random.default_rng(0)
    counts = likelihood.mask_counts(rng, 8, 4)  # k, k+2, k+4, k+6 wrapped into 1..8
    assert sorted((counts - counts[0]) % 8) == [0, 2, 4, 6] and counts.min() >= 1 and counts.max() <= 8
    masks = likelihood.sample_masks(np.random.default_rng(1), 5, 6, 3)
    assert masks.shape == (6, 5) and (masks.sum(1) >= 1).all()
    encode = encoder(model.tokenizer)
    pairs = [(encode("What is 3 + 4 ?"), encode(" 3 + 4 = 7")),  # all in one length bucket
             (encode("Decode: zib"), encode(" zib means purple.")), (encode("Where is Mary ?"), encode(" garden"))]
    a = likelihood.loglikelihood(model, pairs, mc_num=8, group=4, rows=8, seed=5)
    b = likelihood.loglikelihood(model, pairs[::-1], mc_num=8, group=4, rows=3, seed=5)[::-1]
    np.testing.assert_allclose(a, b, rtol=1e-5)
    compiled = likelihood.row_losses._cache_size()
    c = likelihood.loglikelihood(model, pairs, mc_num=8, group=4, rows=8, seed=6)
    assert likelihood.row_losses._cache_size() == compiled  # one program per (rows, length) bucket, compiled once
    assert not np.allclose(a[:2], c[:2]) and np.all(a < 0)
    with pytest.raises(InputError, match="multiple of the sample group"):
        likelihood.loglikelihood(model, pairs, mc_num=6, group=4)
    with pytest.raises(InputError, match="continuation is empty"):
        likelihood.loglikelihood(model, [(pairs[0][0], [])])


@pytest.mark.parametrize("args, message", [
    ({"colour": "blue"}, r"unknown setting\(s\) \['colour'\]"),
    ({"threshold": "abc"}, "threshold must be a number or none, got 'abc'"),
    ({"drop_non_anchor": "maybe"}, "drop_non_anchor must be true or false"),
    ({"anchor_ratio": 1.5}, r"anchor ratio must be in \[0, 1\]"),
    ({"gen_length": 48}, "multiple of block_length"),
    ({"cache": "acache"}, "set affix_mode=prefix|infix|suffix and num_fewshot_affix=N"),
    ({"affix_mode": "middle", "num_fewshot_affix": 1}, "affix_mode must be one of"),
    ({"affix_mode": "prefix"}, "needs both affix_mode"),
    ({"affix_mode": "prefix", "num_fewshot_affix": 1}, "give include_path"),
    ({"engine": True, "cache": "prefix"}, "engine runs the cache policies"),
    ({"mc_num": 10, "batch_size": 4}, "multiple of batch_size"),
    ({"batch_size": 0}, r"batch_size must be an integer in \[1, "),  # not lm-eval's default in its place
    ({"gen_length": 300000000}, r"prompt 1 \+ gen_length 300000000 = 300000001 tokens exceeds the model's context"),
    ({"pretrained": "/no/such/model"}, "not a model directory"),
])
def test_bad_model_args_fail_before_any_work(args, message):
    with pytest.raises(InputError, match=message):
        ACacheLM(**args)


def test_bad_model_args_end_the_command_with_one_line(data):
    run = subprocess.run([sys.executable, "-m", "acache_jax.lm_eval", "--model", "acache_jax", "--model_args",
                          "cache=direct,anchor_ratio=0.2", "--tasks", "acache_codebook"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE})
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "cache=direct" in run.stderr, run.stderr


def test_without_lm_eval_the_command_says_what_to_install(tmp_path):
    """Without the lm-eval extra (an `lm_eval` that fails to import, first on the path), the
    command ends with one line naming the install; importing the adapter raises that ImportError."""
    (tmp_path / "lm_eval").mkdir()
    (tmp_path / "lm_eval" / "__init__.py").write_text("raise ImportError('No module named lm_eval')\n")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "acache_jax.lm_eval", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "acache_jax.lm_eval needs lm-eval: pip install 'acache-jax[lm-eval]'" in run.stderr, run.stderr
    run = subprocess.run([sys.executable, "-c", "import acache_jax.lm_eval"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 1 and run.stderr.strip().endswith("ImportError: acache_jax.lm_eval needs lm-eval: "
                                                               "pip install 'acache-jax[lm-eval]'"), run.stderr


def test_what_these_models_do_not_define(manager):
    lm = ACacheLM()
    # a task's max_gen_toks past the context: refused by arithmetic, naming the document, before any decoding
    huge = Instance("generate_until", {}, ("Question: What is 7 + 5? Answer:", {"max_gen_toks": 10**9}), 0,
                    ("acache_arithmetic", 3, 1))
    with pytest.raises(InputError, match=r"^document 3 of 'acache_arithmetic': prompt \d+ \+ gen_length 1000000000 = "):
        lm.generate_until([huge])
    with pytest.raises(InputError, match="not defined for masked diffusion models"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("text",), 0)])
    with pytest.raises(InputError, match="without --apply_chat_template"):
        lm.chat_template(True)

"""Task generators, scoring, prompt layouts, the tokenizer and the benchmark loaders."""

import json

import numpy as np
import pytest

from acache_jax.decoding.layout import Request
from eval.tasks import MAX_SHOTS, TASKS, eval_split, get_task
from eval.tasks.babi import binding_stories
from eval.tasks.base import answer_number, exact_match
from eval.tasks.codebook import CODE_SIZE
from eval.tasks.layouts import (ASSISTANT, END, GEN_LENGTH, PLACEMENTS, USER, affix_ids, affix_text, encoder, request,
                                target_ids)
from eval.tasks.loaders import LOADERS, load_babilong, load_gsm8k, load_mbpp
from eval.tokenizer import SPECIALS, UNK, build_tokenizer, save_tokenizer, special_ids


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generators_are_deterministic_and_self_consistent(name):
    task = TASKS[name]
    a = task.generate(np.random.default_rng(7), 20)
    b = task.generate(np.random.default_rng(7), 20)
    c = task.generate(np.random.default_rng(8), 20)
    assert [(e.question, e.answer) for e in a] == [(e.question, e.answer) for e in b]
    assert [(e.question, e.answer) for e in a] != [(e.question, e.answer) for e in c]
    assert all(e.score(e.answer) for e in a)  # the reference answer scores as correct
    assert eval_split(task, 3, 5)[1][0].question == eval_split(task, 3, 5)[1][0].question


def test_babi_answer_is_the_last_location_of_the_person_asked():
    for ex in TASKS["babi"].generate(np.random.default_rng(0), 200):
        story = ex.question.split("\n")[1]
        who = ex.question.rsplit("Where is ", 1)[1].rstrip("?")
        moves = [fact.split(" the ")[-1] for fact in story.split(".") if fact.strip().startswith(who + " ")]
        assert 2 <= story.count(".") <= 10 and moves[-1] == ex.answer
    assert exact_match(" Bathroom.", "bathroom") and not exact_match("bathroom kitchen", "bathroom")


def test_babi_draws_stay_the_same_for_a_seed():
    """Held-out questions (and the accuracies reported on them) depend on the order of the draws."""
    ex = TASKS["babi"].generate(np.random.default_rng(0), 1)[0]
    assert ex.question == ("Story:\nSandra journeyed to the garden. John moved to the bathroom. Mary moved to the "
                           "cellar. Sandra went back to the kitchen. Sandra went back to the bedroom. Sandra journeyed "
                           "to the kitchen. Peter went to the cellar. Emma moved to the office. Peter journeyed to the "
                           "bathroom.\nQuestion: Where is Peter?") and ex.answer == "bathroom"


def test_routine_stories_send_everyone_to_their_own_place():
    from eval.tasks import STUDY_TASKS
    from eval.tasks.babi import ROUTINE

    for ex in TASKS["routine"].generate(np.random.default_rng(0), 100):
        facts = [fact.split() for fact in ex.question.split("\n")[1].split(".") if fact.strip()]
        who = ex.question.rsplit("Where is ", 1)[1].rstrip("?")
        assert all(f[-1] == ROUTINE[f[0]] for f in facts) and ex.answer == ROUTINE[who]
        assert [f[-1] for f in facts if f[0] == who][-1] == ex.answer  # also the bAbI answer
    assert len(set(ROUTINE.values())) == len(ROUTINE) and "routine" not in STUDY_TASKS


@pytest.mark.parametrize("ask_first", [True, False])
def test_binding_stories_ask_one_of_distinct_people(ask_first):
    for ex in binding_stories(np.random.default_rng(0), 50, 3, ask_first):
        facts = [fact.split() for fact in ex.question.split("\n")[1].split(".") if fact.strip()]
        who = ex.question.rsplit("Where is ", 1)[1].rstrip("?")
        assert len({f[0] for f in facts}) == len({f[-1] for f in facts}) == 3
        asked = facts[0] if ask_first else facts[-1]
        assert asked[0] == who and asked[-1] == ex.answer
        assert (ex.answer == facts[-1][-1]) == (not ask_first)  # the last-place shortcut fails on "first"


def test_arithmetic_answers_follow_their_equations():
    for ex in TASKS["arithmetic"].generate(np.random.default_rng(0), 200):
        *equations, final = ex.answer.split("\n")
        value = None
        for eq in equations[0].split(". "):
            left, result = eq.rstrip(".").split(" = ")
            a, op, b = left.split()
            assert value in (None, int(a))
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert value == int(result) and 0 <= value <= 99
        assert final == f"The answer is {value}" and answer_number(ex.answer) == value
        assert ex.score(f"blah. The answer is {value}") and not ex.score(f"The answer is {value + 1}")
    assert answer_number("The answer is 1,234") == 1234 and answer_number("no answer") is None


def test_codebook_shots_reveal_the_codebook_that_questions_ask_about():
    def book(ex):
        words = ex.answer.replace(".", "").split()  # "dax means red. wug means blue. ..."
        assert ex.question.split()[1:] == words[0::3]  # decoded in the order asked
        return set(zip(words[0::3], words[2::3]))

    *shots, question = TASKS["codebook"].generate(np.random.default_rng(0), MAX_SHOTS + 1)
    assert book(shots[0]) == book(shots[1]) and len(book(shots[0])) == CODE_SIZE  # one codebook per world
    assert shots[0].question != shots[1].question  # in another order
    assert len(book(question)) == 1 and book(question) <= book(shots[0])  # one word, answered by any shot
    eval_shots, questions = eval_split(TASKS["codebook"], 0, 64)
    assert set().union(*map(book, questions)) == book(eval_shots[0])  # every word asked, each in the shot
    assert len(TASKS["codebook"].generate(np.random.default_rng(0), 1)[0].question.split()) == 2  # no shot
    other = TASKS["codebook"].generate(np.random.default_rng(1), 2)[0]
    assert book(other) != book(shots[0])  # a new world, a new codebook
    assert get_task("codebook").needs_affix


def test_layouts_place_the_affix_as_in_the_paper(tokenizer):
    encode = encoder(tokenizer)
    shots, (question,) = eval_split(TASKS["babi"], 0, 1)
    ids = {p: affix_ids(encode, shots, p) for p in PLACEMENTS}
    reqs = {p: request(encode, question, p) for p in PLACEMENTS}
    assert ids["none"] is None and reqs["none"].affix_position is None and not reqs["none"].tail
    assert ids["prefix"] == ids["suffix"] == encode(affix_text(shots, "prefix"))  # chat turns
    infix = affix_text(shots, "infix")  # a plaintext block
    assert ids["infix"] == encode(infix) and infix.startswith("Example 1:\n") and "\n\nExample 2:\n" in infix
    assert USER not in infix and infix.count(shots[1].answer) >= 1
    user, assistant = (tokenizer.token_to_id(t) for t in (USER, ASSISTANT))
    for p in ("prefix", "suffix", "none"):
        assert reqs[p].prompt[0] == user and reqs[p].prompt[-1] == assistant
    assert reqs["infix"].prompt[0] == user and reqs["infix"].tail[-1] == assistant
    header = encode("Example(s):")
    assert list(reqs["infix"].prompt[-len(header):]) == header
    # As acache_jax.decoding.layout lays them out: prefix [Ex][Qry], infix [Qry_head][Ex][Ans], suffix [Qry] ... [Ex].
    row = reqs["prefix"].row(ids["prefix"], 4, 0)
    assert row.tokens[:len(ids["prefix"])].tolist() == ids["prefix"] and row.affix_start == 0 and row.right == 0
    row = reqs["infix"].row(ids["infix"], 4, 0)
    at = row.affix_start
    assert row.tokens[at:at + len(ids["infix"])].tolist() == ids["infix"] and at == len(reqs["infix"].prompt)
    row = reqs["suffix"].row(ids["suffix"], 4, 0)
    assert row.tokens[row.gen_start + 4:].tolist() == ids["suffix"]
    assert row.tokens[:row.gen_start].tolist() == list(reqs["suffix"].prompt)
    assert isinstance(reqs["suffix"], Request) and reqs["suffix"].affix_position == "suffix"
    with pytest.raises(ValueError, match="at least one"):
        affix_ids(encode, [], "prefix")
    with pytest.raises(ValueError, match="unknown placement"):
        request(encode, question, "middle")


def test_targets_pad_the_generation_with_the_end_token(tokenizer):
    encode, eos = encoder(tokenizer), special_ids(tokenizer)["eos_token_id"]
    for task in TASKS.values():
        for ex in task.generate(np.random.default_rng(0), 100):
            target, answer = target_ids(encode, ex, eos), encode(ex.answer)
            assert len(target) == GEN_LENGTH and target == answer + [eos] * (GEN_LENGTH - len(answer))
    with pytest.raises(ValueError, match="does not fit"):
        target_ids(encode, ex, eos, gen_length=4)


def test_tokenizer_covers_every_task_and_loads_as_hf(tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast

    encode, unk = encoder(tokenizer), tokenizer.token_to_id(UNK)
    rng = np.random.default_rng(5)
    for task in TASKS.values():
        for _ in range(50):
            *shots, ex = task.generate(rng, MAX_SHOTS + 1)
            for p in PLACEMENTS:
                r = request(encode, ex, p)
                assert unk not in [*r.prompt, *r.tail, *(affix_ids(encode, shots, p) or []), *encode(ex.answer)]
    assert build_tokenizer().to_str() == tokenizer.to_str()  # deterministic
    save_tokenizer(tokenizer, tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                          "tokenizer_config.json"]
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    ids = special_ids(tokenizer)
    assert (hf.mask_token_id, hf.eos_token_id, hf.pad_token_id) == (ids["mask_token_id"], ids["eos_token_id"],
                                                                     ids["pad_token_id"])
    assert hf.convert_tokens_to_ids(list(SPECIALS)) == list(range(len(SPECIALS)))
    ex = TASKS["arithmetic"].generate(rng, 1)[0]
    assert encoder(hf)(ex.question) == encode(ex.question)
    assert ex.score(hf.decode(encode(ex.answer) + [ids["eos_token_id"]], skip_special_tokens=True))
    chat = hf.apply_chat_template([{"role": "user", "content": "Where is Mary?"}], add_generation_prompt=True,
                                  tokenize=False)
    assert chat == f"{USER} Where is Mary?\n{ASSISTANT}"
    assert END in SPECIALS


def _write(path, records, jsonl=True):
    path.write_text("\n".join(json.dumps(r) for r in records) if jsonl else json.dumps(records))
    return path


def test_gsm8k_loader(tmp_path):
    path = _write(tmp_path / "gsm8k.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "Big?", "answer": "1000 * 2 = 2000\n#### 2,000"}])
    first, second = load_gsm8k(path)
    assert first.question == "Question: Tom has 3 apples and buys 4. How many?"
    assert first.answer == "3 + 4 = 7\nThe answer is 7"
    assert first.prompt.query(first.question).endswith("Let's think step by step.\nAnswer:")
    assert first.score("so 7. The answer is 7") and not first.score("The answer is 8") and not first.score("7")
    assert second.score("The answer is 2000") and second.score("The answer is 2,000")


def test_mbpp_loader_runs_the_tests(tmp_path):
    path = _write(tmp_path / "mbpp.json", [{"task_id": 1, "text": "Write a function to add two numbers.",
                                           "code": "def add(a, b):\n    return a + b",
                                           "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}],
                  jsonl=False)
    (ex,) = LOADERS["mbpp"](path)
    assert ex.answer.endswith("\n[DONE]") and "assert add(1, 2) == 3" in ex.question
    assert ex.prompt.query(ex.question).endswith("[BEGIN]")
    assert ex.score(ex.answer)
    assert not ex.score("def add(a, b):\n    return a - b\n[DONE]")


def test_babilong_loader(tmp_path):
    path = _write(tmp_path / "qa1.jsonl", [{"input": "Mary moved to the bathroom. John went to the hallway.",
                                            "question": "Where is Mary?", "target": "bathroom"}])
    (ex,) = load_babilong(path)
    assert ex.question == "Story:\nMary moved to the bathroom. John went to the hallway.\nQuestion: Where is Mary?"
    assert ex.score("bathroom") and ex.score("Bathroom.") and not ex.score("hallway")


def test_loaders_report_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gsm8k(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"\n')
    with pytest.raises(ValueError, match="not valid JSON Lines"):
        load_gsm8k(bad)
    with pytest.raises(ValueError, match=r"record 1 needs a str field 'answer'"):
        load_gsm8k(_write(tmp_path / "noanswer.jsonl", [{"question": "q"}]))
    with pytest.raises(ValueError, match="no '#### N'"):
        load_gsm8k(_write(tmp_path / "nofinal.jsonl", [{"question": "q", "answer": "42"}]))
    with pytest.raises(ValueError, match="test_list must be a non-empty list"):
        load_mbpp(_write(tmp_path / "m.jsonl", [{"text": "t", "code": "c", "test_list": []}]))
    with pytest.raises(ValueError, match=r"record 2 needs a str field 'target'"):
        load_babilong(_write(tmp_path / "b.jsonl", [{"input": "s", "question": "q", "target": "x"},
                                                     {"input": "s", "question": "q"}]))
    with pytest.raises(ValueError, match="list of JSON objects"):
        load_babilong(_write(tmp_path / "obj.json", {"input": "s"}, jsonl=False))

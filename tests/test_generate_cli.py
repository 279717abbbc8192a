"""python -m acache_jax.generate: flags, JSONL batches with per-line overrides, tokenizer and errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from acache_jax.generate import main

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--gen-length", "16", "--block-length", "8"]


@pytest.fixture(scope="module")
def model_dir(fixtures_dir):
    return str(fixtures_dir / "decode" / "llada")


@pytest.fixture(scope="module")
def model_with_tokenizer(fixtures_dir, tmp_path_factory):
    """The fixture model plus a word-level tokenizer with a chat template, in HF files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tok_model")
    for f in (fixtures_dir / "decode" / "llada").iterdir():
        shutil.copy(f, directory / f.name)
    words = ["<unk>", "<bos>", "USER", "ASSISTANT"] + [f"w{i}" for i in range(120)] + ["<eos>", "<eot>", "<mask>"]
    vocab = {w: i for i, w in enumerate(words[:125])} | {"<eos>": 126, "<mask>": 127, "<eot>": 125}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   additional_special_tokens=["<eot>"])
    fast.chat_template = "{% for m in messages %}USER {{ m['content'] }} {% endfor %}ASSISTANT"
    fast.save_pretrained(directory)
    return str(directory)


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_prompt_ids_json(capsys, model_dir):
    code, out, err = _run(capsys, "--model", model_dir, "--prompt-ids", "5,17,33,2", "--json", *FAST)
    assert code == 0, err
    row = json.loads(out)
    assert len(row["tokens"]) == 16 and row["nfe"] >= 1 and row["seconds"] > 0 and row["text"] is None


def test_jsonl_batch_overrides_and_order(capsys, model_dir, tmp_path):
    lines = [{"prompt_ids": [5, 17, 33]}, {"prompt_ids": [1, 2], "gen_length": 8}, {"prompt_ids": [9, 9, 9, 9], "cache": "none"}]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code, out, err = _run(capsys, "--model", model_dir, "--input", str(path), "--json", *FAST)
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert [len(r["tokens"]) for r in rows] == [16, 8, 16]
    # each line's result equals that request run on its own
    code, out, _ = _run(capsys, "--model", model_dir, "--prompt-ids", "9,9,9,9", "--cache", "none", "--json", *FAST)
    assert json.loads(out)["tokens"] == rows[2]["tokens"]


def test_chat_template_and_text(capsys, model_with_tokenizer):
    from acache_jax.checkpoint import load
    from acache_jax.generate import _encode, parser

    model = load(model_with_tokenizer)
    tok = model.tokenizer
    chat, plain = parser().parse_args([]), parser().parse_args(["--no-chat"])
    assert _encode({"prompt": "w1 w2 w3"}, chat, model) == ([2, 5, 6, 7, 3], None, [])  # USER w1 w2 w3 ASSISTANT
    assert _encode({"prompt": "w1 w2 w3"}, plain, model)[0] == [5, 6, 7]
    assert _encode({"prompt": "w1", "prompt_ids": [9, 8]}, chat, model)[0] == [9, 8]  # raw ids: no template
    # with an affix, every piece is a plain span: no template, no BOS
    assert _encode({"prompt": "w1", "affix": "w2 w3", "prompt_tail": "w4"}, chat, model) == ([5], [6, 7], [8])
    code, out, err = _run(capsys, "--model", model_with_tokenizer, "--prompt", "w1 w2 w3", "--json", *FAST)
    assert code == 0, err
    row = json.loads(out)
    stops = {125, 126}
    end = next((i for i, t in enumerate(row["tokens"]) if t in stops), 16)
    expected = tok.decode([t for t in row["tokens"][:end]], skip_special_tokens=True)
    assert row["text"] == expected


def test_affix_flags_and_anchors(capsys, model_dir, tmp_path):
    affix = ",".join(str(t) for t in range(30, 50))
    code, out, err = _run(capsys, "--model", model_dir, "--prompt-ids", "5,17,33", "--affix-ids", affix,
                          "--cache", "acache", "--anchor-ratio", "0.2", "--json", *FAST)
    assert code == 0, err
    row = json.loads(out)
    assert len(row["anchors"]) == 4 and row["anchors"] == sorted(row["anchors"])
    lines = [{"prompt_ids": [5, 17, 33], "affix_ids": list(range(30, 50)), "affix_position": "infix",
              "prompt_tail_ids": [7, 8], "cache": "acache"},
             {"prompt_ids": [5, 17, 33], "affix_ids": list(range(30, 50)), "affix_position": "suffix",
              "cache": "direct"},
             {"prompt_ids": [5, 17, 33], "affix_ids": list(range(30, 50)), "cache": "dual"},
             {"prompt_ids": [5, 17, 33], "affix_ids": list(range(30, 50)), "affix_position": "prefix",
              "cache": "acache", "anchor_ratio": 0.5, "anchor_mass": 0.3, "anchor_min_ratio": 0.1}]
    path = tmp_path / "affix.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    code, out, err = _run(capsys, "--model", model_dir, "--input", str(path), "--json", *FAST)
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert len(rows[0]["anchors"]) == 4 and rows[1]["anchors"] == [] and "anchors" not in rows[2]
    assert 2 <= len(rows[3]["anchors"]) <= 10  # the adaptive budget, within 0.1-0.5 of the 20 affix tokens
    code, _, err = _run(capsys, "--model", model_dir, "--prompt-ids", "5", "--affix-ids", affix,
                        "--affix-position", "infix", *FAST)
    assert code == 2 and "needs a prompt tail" in err
    # The engine serves the same lines to the same tokens, and reports its stats.
    code, out, err = _run(capsys, "--model", model_dir, "--input", str(path), "--json", "--engine", *FAST)
    assert code == 0, err
    served = [json.loads(x) for x in out.splitlines()]
    assert [r["tokens"] for r in served] == [r["tokens"] for r in rows]
    assert [r.get("anchors") for r in served] == [r.get("anchors") for r in rows]
    assert served[0]["engine"]["affix_fills"] == 1


@pytest.mark.parametrize("argv,message", [
    (["--prompt-ids", "1,2", "--gen-length", "20", "--block-length", "8"], "multiple of block_length"),
    (["--prompt-ids", "1,2", "--threshold", "2"], "threshold must be in (0, 1]"),
    (["--prompt", "hello"], "ships no tokenizer"),
    ([], "give --prompt"),
])
def test_errors(capsys, model_dir, argv, message):
    code, _, err = _run(capsys, "--model", model_dir, *argv)
    assert code == 2 and message in err


def test_module_entry_point(model_dir):
    run = subprocess.run([sys.executable, "-m", "acache_jax.generate", "--model", model_dir, "--prompt-ids", "3,4",
                          "--cache", "prefix", *FAST], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.split()) == 16 and "nfe" not in run.stdout  # the answer (ids: no tokenizer) on stdout
    assert run.stderr.startswith("[nfe ")  # the statistics on stderr

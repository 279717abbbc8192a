"""python -m acache_jax.generate: flags, JSONL batches with per-line overrides, tokenizer and errors."""

import json
import os
import pty
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from acache_jax.generate import DECODE_KEYS, MAX_REPORTED, REQUEST_KEYS, main
from tests.cli_process import run_cli

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
    from acache_jax.generate import _encode, parser
    from acache_jax.network.checkpoint import load

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
              "cache": "acache", "anchor_ratio": 0.5, "anchor_mass": 0.3, "anchor_min_ratio": 0.1},
             {"prompt_ids": [5, 17], "affix_ids": list(range(30, 50)), "affix_position": "infix",
              "prompt_tail_ids": [7, 8], "cache": "acache", "gen_length": 24}]  # the engine of the first line
    path = tmp_path / "affix.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    code, out, err = _run(capsys, "--model", model_dir, "--input", str(path), "--json", *FAST)
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert len(rows[0]["anchors"]) == 4 and rows[1]["anchors"] == [] and "anchors" not in rows[2]
    assert 2 <= len(rows[3]["anchors"]) <= 10  # the adaptive budget, within 0.1-0.5 of the 20 affix tokens
    assert len(rows[4]["tokens"]) == 24
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
    # the last line ran in the first line's engine (one engine key): whichever finished last counts both
    assert max(served[i]["engine"]["generated_tokens"] for i in (0, 4)) == 16 + 24


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


def test_input_from_pipes_reports_every_bad_line(model_dir, tmp_path):
    """--input reads a FIFO (what `<(...)` gives) and /dev/stdin; a file's bad lines are all reported
    (up to MAX_REPORTED, then counted), each with its line, before any work and in seconds."""
    bad = [b'{"prompt": "caf\xe9"}', b'{"prompt": "\\ud800"}', b'{"prompt_ids": [1], "gen_length": 10000000000}',
           b'{"prompt": ""}', b'{"prompt_ids": [1], "colour": 1}', b'{"prompt_ids": [1], ']
    lines = [b'{"prompt_ids": [1, 2]}'] + [bad[i % len(bad)] for i in range(MAX_REPORTED + 4)]
    data = b"\n".join(lines) + b"\n"
    fifo = tmp_path / "requests.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data))
    writer.start()
    for name, argv, stdin in ((fifo, ["--input", fifo], b""), ("/dev/stdin", ["--input", "/dev/stdin"], data)):
        code, out, err, seconds, peak = run_cli(["--model", model_dir, *argv, *FAST], stdin=stdin)
        reported = err.splitlines()
        known = sorted([*REQUEST_KEYS, *DECODE_KEYS])
        assert code == 2 and out == "" and "Traceback" not in err, err
        assert reported[:6] == [f"error: {name}:2: not valid UTF-8 (byte 0xe9 at column 16)",
                                f"error: {name}:3: prompt is not valid Unicode text: character 0 is the lone "
                                "surrogate \\ud800 (bytes that are not UTF-8, or a \\uXXXX escape without its pair)",
                                f"error: {name}:4: prompt 1 + gen_length 10000000000 = 10000000001 tokens exceeds "
                                "the model's context of 256",
                                f"error: {name}:5: prompt is empty",
                                f"error: {name}:6: unknown keys ['colour']; known: {known}",
                                f"error: {name}:7: not valid JSON (Expecting property name enclosed in double quotes: "
                                "line 1 column 21 (char 20))"]
        assert len(reported) == MAX_REPORTED + 1 and reported[-1] == "error: and 4 more bad lines", err
        assert seconds < 20 and peak < 2**30, (seconds, peak)
    writer.join()


def test_stdin_and_a_terminal_hears_of_compiles(tmp_path):
    """`--input -` reads the requests from standard input; a stderr that is a terminal gets one line
    while a program compiles (the answers on stdout are as ever). Runs without any compilation
    cache, on the shipped model, whose decode program compiles for over a second."""
    lines = [{"prompt": "Story: John went to the hallway. Question: Where is John? Answer with one location:"},
             {"prompt": "Story: Mary went to the garden. Question: Where is Mary? Answer with one location:"}]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("XLA_FLAGS", None)  # the compiler's default optimisation: the compile takes seconds
    terminal, stderr = pty.openpty()
    code, out, _, _, _ = run_cli(["--input", "-", "--json", "--compile-cache", "off"],
                                 stdin="".join(json.dumps(x) + "\n" for x in lines).encode(), stderr=stderr, env=env)
    err = b""
    while True:
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # the child's end is closed: everything is read
            break
        if not chunk:
            break
        err += chunk
    os.close(terminal)
    err = err.decode().replace("\r\n", "\n")
    assert code == 0, err
    assert [json.loads(x)["text"] for x in out.splitlines()] == ["hallway", "garden"]
    note = ("acache-jax: compiling a program for this shape (the compilation cache is off, so every run compiles "
            "it)...")
    assert err.strip() == note  # once, and nothing else: with --json the statistics are in the JSON

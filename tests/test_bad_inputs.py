"""Every bad input a new user met gets one clear line naming the problem (exit code 2 on the command
line, `InputError` in the API), never a traceback or a silently wrong result."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import acache_jax
from acache_jax import AffixCache, DecodeConfig, Engine, InputError, Request
from acache_jax.decoding.decode import generate
from acache_jax.generate import main
from tests.cli_process import run_cli
from tests.hf_checkpoints import llada_config, random_weights, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--gen-length", "16", "--block-length", "8"]


@pytest.fixture(scope="module")
def model_dir(fixtures_dir):
    return fixtures_dir / "decode" / "llada"


@pytest.fixture(scope="module")
def model(model_dir):
    return acache_jax.load(model_dir, dtype="float32")


def _cli(capsys, argv):
    """(exit code, stdout, stderr) of the command in-process (argparse's own exits included)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(code, out, err, message):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert message in lines[0], lines[0]
    assert out == ""  # nothing was decoded


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "-1"], "--batch-size: must be a positive integer, got -1"),
    (["--batch-size", "0"], "--batch-size: must be a positive integer, got 0"),
    (["--engine", "--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--engine", "--pool-tokens", "-5"], "--pool-tokens: must be a positive integer, got -5"),
    (["--engine", "--pool-tokens", "0"], "--pool-tokens: must be a positive integer, got 0"),
    (["--steps", "0"], "--steps: must be a positive integer, got 0"),
    (["--seed", "99999999999999999999"], "--seed: must be an integer in [0, 4294967295]"),
    (["--backend", "cudnn"], "attention backend 'cudnn' needs a GPU"),
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--affix-ids", "5,6", "--affix-position", "prefix", "--prompt-tail-ids", "4"],
     "a prompt tail goes after an infix affix"),
    (["--affix-ids", "5,6", "--affix-position", "suffix", "--prompt-tail-ids", "4"],
     "a prompt tail goes after an infix affix"),
    (["--affix-position", "suffix"], "affix_position 'suffix' given without an affix"),
    (["--cache", "acache"], "cache policy 'acache' needs an affix"),
    (["--engine", "--cache", "prefix"], "the engine runs the cache policies"),
    (["--prompt-ids", "1,2,999"], "token ids outside the vocabulary [0, 128): [999]"),
    (["--factor", "1.0", "--threshold", "0.5"], "--factor and --threshold are two rules"),
    (["--anchor-mass", "0.3"], "--anchor-mass sets the anchor budget of cache acache with an affix; this request "
                               "has no affix"),
    (["--affix-ids", "5,6", "--anchor-mass", "0.3", "--cache", "dual"], "the cache policy is 'dual'"),
    (["--alg", "entropy"], "--alg is a setting of Dream models' sampler; this model is a LLaDA model"),
    (["--top-p", "0.9"], "--top-p is a setting of Dream models' sampler; this model is a LLaDA model"),
    (["--affix-ids", ""], "the affix is empty"),
    (["--affix-ids", "5,6", "--affix-position", "infix", "--prompt-tail", "a\udcff"],
     "--prompt-tail is not valid Unicode text: character 1 is the lone surrogate \\udcff"),
    (["--affix-ids", "5,6", "--affix-position", "infix", "--prompt-tail", ""], "--prompt-tail is empty"),
    (["--prompt", ""], "--prompt is empty"),  # as the API and the server refuse it
    (["--prompt", "hi", "--affix", "\udcff\udcfe"], "--affix is not valid Unicode text: character 0"),
])
def test_bad_flags(capsys, model_dir, argv, message):
    given = "--prompt-ids" in argv or "--prompt" in argv
    argv = ["--model", model_dir, *([] if given else ["--prompt-ids", "1,2,3"]), *argv, *FAST]
    _one_line_error(*_cli(capsys, argv), message)


# The shipped model (a tokenizer: text flags) and the fixture (ids only): each case is refused on one
# line, before anything that grows with the lengths is built: at main ddbd83e `--gen-length
# 300000000` took 37 s and 6 GB, and 10**10 ended in a MemoryError.
SHIPPED = ROOT / "acache_jax" / "models" / "llada-small"
REFUSED_QUICKLY = [
    (["--prompt", "hi", "--gen-length", "300000000"], "prompt 3 + gen_length 300000000 = 300000003 tokens exceeds "
                                                      "the model's context of 512"),
    (["--prompt", "hi", "--gen-length", "1e10"], "argument --gen-length: must be a positive integer, got 1e10"),
    (["--prompt", "hi", "--engine", "--gen-length", "10000000000"], "gen_length 10000000000 = 10000000003 tokens"),
    (["--prompt", b"caf\xe9"], "--prompt is not valid Unicode text: character 3 is the lone surrogate \\udce9"),
]


@pytest.mark.parametrize("argv,message", REFUSED_QUICKLY)
def test_cli_refuses_before_building_anything(argv, message):
    code, out, err, seconds, peak = run_cli(["--model", SHIPPED, *argv])
    _one_line_error(code, out, err, message)
    # the process's whole life (imports and the model's load included): seconds and a few hundred MB
    assert seconds < 20 and peak < 2**30, (seconds, peak)


@pytest.mark.parametrize("line,message", [
    ("null", ":2: expected a JSON object, got null"),
    ('{"prompt_ids": [1, 2], "gen_length": "16"}', ":2: gen_length must be an integer, got '16'"),
    ('{"prompt_ids": [1, 2], "gen_length": 16.0}', ":2: gen_length must be an integer, got 16.0"),
    ('{"prompt_ids": [1, 2], "threshold": "none"}', ":2: threshold must be a finite number or null, got 'none'"),
    ('{"prompt_ids": [1, 2], "seed": "abc"}', ":2: seed must be int, got \"abc\""),
    ('{"prompt_ids": [1, 2], "seed": -1}', ":2: seed must be an integer in [0, 4294967295], got -1"),
    ('{"prompt_ids": "1,2,3"}', ":2: prompt_ids must be a list, got \"1,2,3\""),
    ('{"prompt_ids": [5, "x"]}', ":2: prompt_ids must hold integer token ids, found 'x'"),
    ('{"prompt": 123}', ":2: prompt must be str, got 123"),
    ('{"prompt_ids": [1], "no_chat": "false"}', ":2: no_chat must be bool, got \"false\""),
    ('{"prompt_ids": [1], "drop_non_anchor": "yes"}', ":2: drop_non_anchor must be true or false, got 'yes'"),
    ('{"prompt_ids": [1], "anchor_mass": "half"}', ":2: anchor_mass must be a finite number or null, got 'half'"),
    ('{"prompt_ids": [1], "colour": "red"}', ":2: unknown keys ['colour']"),
    ('{"prompt_ids": [1], ', ":2: not valid JSON"),
    ('{"prompt": "\\ud800"}', ":2: prompt is not valid Unicode text: character 0 is the lone surrogate \\ud800"),
    ('{"prompt_ids": [1], "affix": "ab\\udfff", "affix_position": "suffix"}', ":2: affix is not valid Unicode text"),
    ('{"prompt": ""}', ":2: prompt is empty"),
    ('{"prompt_ids": [1], "gen_length": 10000000000}',
     ":2: prompt 1 + gen_length 10000000000 = 10000000001 tokens exceeds the model's context of 256"),
    ('{"prompt_ids": [1], "factor": 1.0, "threshold": null}', ":2: factor and threshold are two rules"),
    ('{"prompt_ids": [1], "anchor_mass": 0.3}', ":2: anchor_mass sets the anchor budget"),
    ('{"prompt_ids": [1], "affix_ids": []}', ":2: the affix is empty"),
])
def test_bad_jsonl_lines_name_the_line(capsys, model_dir, tmp_path, line, message):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n' + line + "\n")
    _one_line_error(*_cli(capsys, ["--model", model_dir, "--input", path, *FAST]), f"{path}{message}")


def test_bad_input_files(capsys, model_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    _one_line_error(*_cli(capsys, ["--model", model_dir, "--input", empty]), "holds no requests")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"prompt_ids": [1]}\r\n\n{"prompt": "caf\xe9"}\n')
    _one_line_error(*_cli(capsys, ["--model", model_dir, "--input", latin1, *FAST]),
                    f"{latin1}:3: not valid UTF-8 (byte 0xe9 at column 16)")
    _one_line_error(*_cli(capsys, ["--model", model_dir, "--input", tmp_path]), "is a directory; give a JSONL file")
    _one_line_error(*_cli(capsys, ["--model", model_dir, "--input", tmp_path / "nope.jsonl"]), "does not exist")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_model_directories(capsys, model_dir, tmp_path):
    run = lambda d: _cli(capsys, ["--model", d, "--prompt-ids", "1,2", *FAST])
    _one_line_error(*run(model_dir / "config.json"), "config.json is a file; a model is a directory")
    _one_line_error(*run(tmp_path / "nope"), "does not exist")
    listed = _copy(model_dir, tmp_path / "list")
    (listed / "config.json").write_text("[]")
    _one_line_error(*run(listed), "config.json must hold a JSON object, got list")
    torn = _copy(model_dir, tmp_path / "torn")
    (torn / "config.json").write_text('{"model_type": "llada", ')
    _one_line_error(*run(torn), "config.json is not valid JSON")
    bad_gen = _copy(model_dir, tmp_path / "gen")
    (bad_gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": "32"}))
    _one_line_error(*run(bad_gen), "generation_config.json: max_new_tokens must be an integer, got '32'")
    (bad_gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40, "block_length": 16}))
    _one_line_error(*run(bad_gen),
                    "generation_config.json: max_new_tokens (40) must be a multiple of block_length (16)")
    # a valid default that a flag or the prompt makes wrong: the error says where the default came from
    source = bad_gen / "generation_config.json"
    source.write_text(json.dumps({"max_new_tokens": 320, "block_length": 32}))
    default = f"(gen_length 320 is the model's default, from max_new_tokens in {source})"
    _one_line_error(*_cli(capsys, ["--model", bad_gen, "--prompt-ids", "1,2"]),
                    f"prompt 2 + gen_length 320 = 322 tokens exceeds the model's context of 256 {default}")
    source.write_text(json.dumps({"max_new_tokens": 32, "block_length": 32}))
    _one_line_error(*_cli(capsys, ["--model", bad_gen, "--prompt-ids", "1,2", "--block-length", "64"]),
                    "gen_length (32) must be a multiple of block_length (64) (gen_length 32 is the model's default, "
                    f"from max_new_tokens in {source})")
    (bad_gen / "generation_config.json").write_text(json.dumps({"mask_token_id": 5}))
    _one_line_error(*run(bad_gen), "mask_token_id 5 differs from config.json's 127")


def test_corrupt_checkpoints(capsys, model_dir, tmp_path):
    """A converted checkpoint with deleted parameter files, an HF one with a torn index, weights
    overwritten with NaN: each is named, nothing decodes."""
    converted = tmp_path / "converted"
    assert subprocess.run([sys.executable, "-m", "convert", str(model_dir), str(converted)], cwd=ROOT,
                          capture_output=True).returncode == 0
    for f in (converted / "params").rglob("*"):
        if f.is_file() and "ocdbt" in str(f.relative_to(converted)):
            f.unlink()
    _one_line_error(*_cli(capsys, ["--model", converted, "--prompt-ids", "1,2", *FAST]),
                    "is damaged: ")

    sharded = write_checkpoint(tmp_path / "sharded", llada_config(), random_weights(llada_config()), shards=2)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    _one_line_error(*_cli(capsys, ["--model", sharded, "--prompt-ids", "1,2", *FAST]),
                    "model.safetensors.index.json is not valid JSON")
    run = subprocess.run([sys.executable, "-m", "convert", str(sharded), str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "model.safetensors.index.json" in run.stderr

    nan = _copy(model_dir, tmp_path / "nan")
    weights = load_file(str(nan / "model.safetensors"))
    weights["model.transformer.blocks.1.up_proj.weight"][3, 4] = np.nan
    save_file(weights, str(nan / "model.safetensors"))
    _one_line_error(*_cli(capsys, ["--model", nan, "--prompt-ids", "1,2", *FAST]),
                    "parameters hold NaN or inf values: layers.1.mlp.gate_up.kernel")


def test_corrupt_tokenizer_is_named(capsys, tmp_path):
    """The tokenizer is loaded at its first use (LazyTokenizer): a damaged tokenizer.json is named
    there, by the CLI as one error line and by the server before it listens; the weights load
    without it."""
    shipped = _copy(ROOT / "acache_jax" / "models" / "llada-small", tmp_path / "m")
    (shipped / "tokenizer.json").write_text('{"model": ')
    _one_line_error(*_cli(capsys, ["--model", shipped, "--prompt", "hello"]), "tokenizer.json")
    model = acache_jax.load(shipped)
    assert model.tokenizer is not None
    with pytest.raises(InputError, match="tokenizer.json"):
        model.encode("hello")
    from acache_jax.serve.cli import main as serve_main

    assert serve_main(["--model", str(shipped), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tokenizer.json" in err, err


def test_api_misuse(model, model_dir):
    cfg = DecodeConfig(gen_length=16, block_length=8)
    cases = [
        (lambda: generate(model, "hello", cfg), "got a string; tokenize it first"),
        (lambda: generate(model, [1, 2, 3], cfg), "one flat list of token ids"),
        (lambda: generate(model, [[1, 2.5]], cfg), "prompt 0 must hold integer token ids, found 2.5"),
        (lambda: generate(model, [[1, 2]], {"gen_length": 16}), "config must be a DecodeConfig"),
        (lambda: generate(model, [[1, 2]], cfg, max_batch=-1), "max_batch must be a positive integer"),
        (lambda: generate(model, [[1, 2]], cfg, max_batch=0), "max_batch must be a positive integer"),
        (lambda: generate(model, [Request([1, 2], seed=2**40)], cfg), "seed must be an integer"),
        (lambda: generate(model, [[1, 2]], DecodeConfig(temperature=float("inf"))), "finite number"),
        (lambda: generate(model, [[1, 2]], DecodeConfig(steps=0)), "steps (0) must be a positive"),
        (lambda: model.decode_config(colour="red"), "unknown decoding setting(s) ['colour']"),
        (lambda: model.decode_config(anchor_mass=0.0), "anchor mass must be in (0, 1], got 0.0"),
        (lambda: model.decode_config(anchor_mass="all"), "anchor_mass must be a finite number or null"),
        (lambda: model.decode_config(anchor_mass=0.5, anchor_ratio=0.2, anchor_min_ratio=0.3),
         "anchor min ratio must be in [0, anchor_ratio=0.2], got 0.3"),
        (lambda: model.decode_config(anchor_mass=0.5, selector="bottom"), "scores are importances, not 'bottom'"),
        (lambda: Engine(model, cfg, block_size=0), "block_size must be a positive integer, got 0"),
        (lambda: Engine(model, cfg, pool_tokens=0), "pool_tokens must be a positive integer, got 0"),
        (lambda: Engine(model, cfg, max_batch=-3), "max_batch must be a positive integer, got -3"),
        (lambda: model.logits([[1, 2, 999]]), "token ids outside the vocabulary [0, 128): [999]"),
        (lambda: model.logits([[5.5, 6.2]]), "must be integer token ids shaped [B, T], got float64[1, 2]"),
        (lambda: acache_jax.load(model_dir, dtype="float16x"), "dtype must be one of"),
    ]
    for call, message in cases:
        with pytest.raises(InputError) as err:
            call()
        assert message in str(err.value), (message, str(err.value))


@pytest.fixture(scope="module")
def shipped():
    return acache_jax.load(SHIPPED)


def test_lengths_are_checked_before_anything_is_built(model):
    """A generation length far past the context is refused by arithmetic, on every library path:
    no row, buffer or program of its size is built (here 2**26 masks would be 0.8 GB of rows)."""
    huge = 2**26
    cfg = DecodeConfig(gen_length=16, block_length=8)
    engine = Engine(model, cfg, pool_tokens=1024)
    message = f"prompt 2 + gen_length {huge} = {huge + 2} tokens exceeds the model's context of 256"
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(InputError) as static:
        generate(model, [[1, 2]], cfg.replace(gen_length=huge))
    with pytest.raises(InputError) as added:
        engine.add(Request([1, 2]), gen_length=huge)
    with pytest.raises(InputError) as affixed:
        generate(model, [Request([1, 2], affix_position="prefix")], cfg.replace(gen_length=huge), affix=[5] * 20)
    seconds, peak = time.perf_counter() - start, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(static.value) == f"request 0: {message}" and str(added.value) == message
    assert str(affixed.value).endswith(f"prompt 2 + affix 20 + gen_length {huge} = {huge + 22} tokens exceeds the "
                                       "model's context of 256")
    assert seconds < 1 and peak < 16 * 2**20, (seconds, peak)


def test_engine_errors_name_the_request(model):
    """`Engine.add` takes one request: its error names no index; `Engine.generate` names the request's
    index in the call, and queues none of them when one is bad."""
    engine = Engine(model, DecodeConfig(gen_length=16, block_length=8), pool_tokens=1024)
    with pytest.raises(InputError, match="^empty prompt$"):
        engine.add(Request([]))
    with pytest.raises(InputError, match="^request 2: token ids outside the vocabulary"):
        engine.generate([Request([1, 2]), Request([3]), Request([4, 999])])
    with pytest.raises(InputError, match="^request 1: affix_position 'prefix' given without an affix"):
        engine.generate([Request([1, 2]), Request([3], affix_position="prefix")])
    assert engine.run() == []  # nothing of the refused calls was queued


def test_text_that_is_not_unicode(shipped):
    """A lone surrogate (a JSON escape without its pair, or argv bytes that are not UTF-8) is named,
    not a TypeError from inside the tokenizer."""
    for text, where in (("a\ud800", 1), ("caf\udce9", 3)):
        with pytest.raises(InputError, match=f"text is not valid Unicode text: character {where} is the lone"):
            shipped.encode(text)
        with pytest.raises(InputError, match="not valid Unicode"):
            shipped.encode(text, chat=False, special_tokens=False)
    with pytest.raises(InputError, match="text must be a string, got bytes"):
        shipped.encode(b"hello")


def test_engine_takes_a_built_affix_cache(model, shipped):
    """engine.add(request, AffixCache) decodes as with the affix ids."""
    cfg = DecodeConfig(gen_length=16, block_length=8, cache="acache", anchor_ratio=0.25)
    affix_ids = list(range(30, 50))
    cache = acache_jax.build_affix_cache(model, affix_ids)
    request = Request([5, 17, 33], affix_position="infix", tail=[7, 8])
    from_cache = Engine(model, cfg, pool_tokens=1024).generate([request], cache)
    from_ids = Engine(model, cfg, pool_tokens=1024).generate([request], affix_ids)
    np.testing.assert_array_equal(from_cache[0].tokens, from_ids[0].tokens)
    np.testing.assert_array_equal(from_cache[0].anchors, from_ids[0].anchors)
    with pytest.raises(InputError, match="built with another model"):
        Engine(shipped, cfg, pool_tokens=1024).add(request, cache)
    assert isinstance(cache, AffixCache)

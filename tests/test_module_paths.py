"""The modules' paths from before the library's folders (`acache_jax.model`, `acache_jax.decode`, ...)
still import: each is the moved module itself, so code written against the old paths, and patches
made through them, keep working; each old path warns once with a DeprecationWarning naming the new.
Run in fresh interpreters: an old path warns only on its first import in a process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Written out here, not read from the library: old path -> new path.
MOVED = {f"acache_jax.{name}": f"acache_jax.{folder}.{name}" for folder, names in [
    ("network", "attention checkpoint config files hf_checkpoint kv model sharding tokenizer"),
    ("decoding", "acache decode layout sampling"),
    ("lm_eval", "chat_layout likelihood")] for name in names.split()}


def _python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_every_old_path_is_the_moved_module():
    code = (f"import importlib, sys\nmoved = {MOVED!r}\n"
            "for old, new in moved.items():\n"
            "    a, b = importlib.import_module(old), importlib.import_module(new)\n"
            "    assert a is b and sys.modules[old] is b, old\n"
            "    assert b.__name__ == b.__spec__.name == new, (b.__name__, b.__spec__.name)\n"
            "import acache_jax\n"
            "from acache_jax import decode, model\n"
            "from acache_jax.decoding import decode as new_decode\n"
            "assert decode is new_decode and acache_jax.layout is sys.modules['acache_jax.decoding.layout']\n"
            "import acache_jax.config as old_config\n"
            "from acache_jax.network.config import DecodeConfig\n"
            "assert old_config.DecodeConfig is DecodeConfig\n"
            "old_config.patched = 1\n"  # a patch through the old path is seen through the new
            "assert sys.modules['acache_jax.network.config'].patched == 1\n"
            "print('ok')")
    run = _python(code, "-W", "ignore::DeprecationWarning")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_an_old_path_warns_and_a_new_one_does_not():
    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import acache_jax.decoding.decode, acache_jax.network.model\n"
            "    new = [str(w.message) for w in seen if 'acache_jax' in str(w.message)]\n"
            "    import acache_jax.decode\n"
            "    from acache_jax import layout\n"
            "    old = [(w.category.__name__, str(w.message), w.filename, w.lineno) for w in seen\n"
            "           if 'acache_jax' in str(w.message)]\n"
            "print(new, old)")
    run = _python(code)
    assert run.returncode == 0, run.stderr
    # each warning points at the user's line that imported the old path (here: <string>, lines 6 and 7)
    assert run.stdout.strip() == ("[] [('DeprecationWarning', 'acache_jax.decode is now acache_jax.decoding.decode', "
                                  "'<string>', 6), ('DeprecationWarning', 'acache_jax.layout is now "
                                  "acache_jax.decoding.layout', '<string>', 7)]"), run.stdout


def test_an_unknown_name_is_still_an_error():
    run = _python("import acache_jax.nothing_here")
    assert run.returncode != 0 and "ModuleNotFoundError" in run.stderr, run.stderr
    run = _python("import acache_jax; acache_jax.nothing_here")
    assert run.returncode != 0 and "has no attribute 'nothing_here'" in run.stderr, run.stderr

"""What the command lines share: the default model, flag types, the --compile-cache flag, and an
argument parser that reports a bad flag in one line.

Why here: `python -m acache_jax.generate`, `python -m acache_jax.serve` and the lm-eval adapter
each parse their own flags, and each must read them the same way (a threshold of 'none', a count
that must be positive, the compilation cache's setting); none of them should depend on another's
module for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from acache_jax import compile_cache

# The shipped LLaDA-architecture model (acache_jax/models/README.md); used when --model is not given.
DEFAULT_MODEL = Path(__file__).resolve().parent / "models" / "llada-small"


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (no usage block) with exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def threshold(text: str) -> float | None:
    """A confidence threshold, or 'none' for the fixed schedule."""
    return None if text.lower() == "none" else float(text)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _compile_cache_setting(text: str) -> str:
    try:
        return compile_cache.check_setting(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_compile_cache(p: argparse.ArgumentParser) -> None:
    """--compile-cache, for the command lines that compile (acache_jax.compile_cache says why)."""
    p.add_argument("--compile-cache", metavar="DIR|off", type=_compile_cache_setting, default=None,
                   help="keep compiled programs in DIR for later processes, or 'off' (default: "
                        f"${compile_cache.ENV_VAR}, else $XDG_CACHE_HOME/{compile_cache.SUBDIR.as_posix()})")

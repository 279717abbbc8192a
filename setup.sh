#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 (JAX needs it) and install acache-jax with its test extras,
# at the versions pinned in constraints.txt.
# Set PYTHON=/path/to/python3.12 to choose the interpreter yourself.
set -euo pipefail
cd "$(dirname "$0")"

is_new_enough() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local cand v root
  for cand in "${PYTHON:-}" python3.14 python3.13 python3.12 python3 python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && is_new_enough "$cand" && { command -v "$cand"; return; }
  done
  # pyenv keeps installed versions off PATH until one is selected: look inside its root.
  if command -v pyenv >/dev/null 2>&1; then
    root=$(pyenv root)
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.[0-9]+' | sort -t. -k1,1n -k2,2n -k3,3n -r); do
      cand="$root/versions/$v/bin/python3"
      [ -x "$cand" ] && is_new_enough "$cand" && { echo "$cand"; return; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_new_enough .venv/bin/python; then
  py=$(find_python) || { echo "setup.sh: no Python >= 3.12 found; install one or set PYTHON=..." >&2; exit 1; }
  echo "setup.sh: creating .venv with $py ($("$py" --version 2>&1))" >&2
  rm -rf .venv
  "$py" -m venv .venv
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ] || [ constraints.txt -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # Pinned versions (constraints.txt): CI and every set-up get the environment the suite was run in.
  .venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[test]"
  # Byte-compile what was installed, and this project's packages, on every core at once (pip
  # compiles one file at a time). Python compiles a module when a process first imports it and
  # keeps the result, but not where PYTHONDONTWRITEBYTECODE is set (as on the 2-core machines this
  # suite is timed on): each process then compiled jax, flax and the rest from source again, 1.6 s
  # of its 3 s of imports. A file that does not compile (warnings are silenced) is compiled at import.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 "$site" acache_jax convert eval pallas_kernels tests 2>/dev/null \
    || echo "setup.sh: some files were not byte-compiled; Python compiles them when imported" >&2
  touch .venv/.installed
fi

"""Writing results and checkpoints so that an interrupted run leaves either the old file or the new
one, never a torn one, and checking an output path before the work that fills it.

Temporary names carry the writer's process id (`.NAME.partial-PID-XXXX`), so a later run can tell a
leftover of a dead process from a write in progress and remove only the former.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from acache_jax.network.config import InputError

PARTIAL = ".partial-"


def partial_name(path: Path) -> Path:
    """A hidden sibling of `path` for writing it: `.NAME.partial-PID-XXXXXXXX`."""
    return path.parent / f".{path.name}{PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_partials(path: Path) -> list[Path]:
    """Remove leftovers of interrupted writes of `path` whose writer process is gone; returns them."""
    removed = []
    for leftover in path.parent.glob(f".{path.name}{PARTIAL}*"):
        pid = leftover.name[len(f".{path.name}{PARTIAL}"):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)
            removed.append(leftover)
    return removed


def write_atomic(path: str | Path, data: str | bytes | Callable[[Path], None]) -> Path:
    """Write `data` (text, bytes, or a function that writes the file it is given) to a temporary
    sibling, then rename it over `path`. Parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_name(path)
    try:
        if callable(data):
            data(tmp)
        elif isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        os.chmod(tmp, 0o644)  # some writers (safetensors) create files readable by their owner only
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def check_output_path(path: str | Path) -> Path:
    """Create the parent directories of an output file and check it can be written, before the work
    that produces it starts (a long run must not die at its last line)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"output {path} is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create the directory of output {path}: {e.strerror or e}") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"output {path} is not writable")
    return path

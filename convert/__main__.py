"""python -m convert SRC_DIR DST_DIR [--dtype bfloat16|float32]"""

import argparse
import shutil
import signal
import sys
from pathlib import Path

from acache_jax.network.config import InputError
from convert import convert


_received: list[int] = []


def _interrupt(signum, frame):
    """TERM as INT: the write in progress unwinds and removes its temporary directory. The signal is
    remembered too: Python drops an exception raised inside a garbage-collector callback."""
    _received.append(signum)
    raise KeyboardInterrupt


def _unraisable(info) -> None:
    """A dropped interrupt is handled after the conversion; other unraisable errors print as usual."""
    if not isinstance(info.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(info)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert an HF LLaDA or Dream snapshot directory into an acache-jax checkpoint.",
    )
    parser.add_argument("src", help="HF snapshot directory (config.json + safetensors [+ index] + tokenizer)")
    parser.add_argument("dst", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    _received.clear()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    sys.unraisablehook = _unraisable
    existed = Path(args.dst).is_dir()  # empty (convert refuses anything else)
    try:
        out = convert(args.src, args.dst, args.dtype)
        if _received:  # the interrupt was dropped and the conversion finished: honour it all the same
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second one must not stop the removal halfway
                signal.signal(sig, signal.SIG_IGN)
            shutil.rmtree(out)
            if existed:
                out.mkdir()
            raise KeyboardInterrupt
    except BaseException as e:
        # What unwinds after a signal is the interrupt, whatever its type: a KeyboardInterrupt
        # raised inside Python code that C code called (numpy hashing a jax dtype) reaches here as
        # the SystemError that C code raises. `save` removed its partial write either way.
        if _received or isinstance(e, KeyboardInterrupt):
            print(f"interrupted: nothing was written to {args.dst}", file=sys.stderr)
            return 130
        if isinstance(e, (InputError, FileExistsError, OSError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m convert SRC_DIR DST_DIR [--dtype bfloat16|float32]"""

import argparse
import signal
import sys

from acache_jax.config import InputError
from convert import convert


def _interrupt(signum, frame):
    """SIGTERM as Ctrl-C: the write in progress unwinds and removes its temporary directory."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert an HF LLaDA or Dream snapshot directory into an acache-jax checkpoint.",
    )
    parser.add_argument("src", help="HF snapshot directory (config.json + safetensors [+ index] + tokenizer)")
    parser.add_argument("dst", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        out = convert(args.src, args.dst, args.dtype)
    except (InputError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: nothing was written to {args.dst}", file=sys.stderr)
        return 130
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m convert SRC_DIR DST_DIR [--dtype bfloat16|float32]"""

import argparse
import sys

from acache_jax.config import ConfigError
from convert import CheckpointError, convert


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert an HF LLaDA or Dream snapshot directory into an acache-jax checkpoint.",
    )
    parser.add_argument("src", help="HF snapshot directory (config.json + safetensors [+ index] + tokenizer)")
    parser.add_argument("dst", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    try:
        out = convert(args.src, args.dst, args.dtype)
    except (ConfigError, CheckpointError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

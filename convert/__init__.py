"""HF LLaDA/Dream checkpoints -> acache-jax checkpoints: `python -m convert SRC_DIR DST_DIR`.

The checkpoint layout itself lives in `acache_jax.network.hf_checkpoint` (the library reads HF snapshots
directly too); this package is the command that writes our format from it.
"""

from __future__ import annotations

from pathlib import Path

from acache_jax.network.checkpoint import DTYPES, check_destination, read_hf, save
from acache_jax.network.config import ModelConfig, read_json
from acache_jax.network.hf_checkpoint import CheckpointError

__all__ = ["CheckpointError", "convert"]


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> Path:
    """Convert the HF snapshot directory `src` into our checkpoint at `dst` (atomically)."""
    src, dst = Path(src), Path(dst)
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory (an HF snapshot: config.json + safetensors + tokenizer)")
    check_destination(dst.absolute())
    cfg = ModelConfig.from_file(src)
    params = read_hf(src, cfg, DTYPES[dtype], desc="converting")
    return save(dst, read_json(src / "config.json"), params, dtype, tokenizer_dir=src)

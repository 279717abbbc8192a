"""HF LLaDA/Dream checkpoints -> acache-jax checkpoints: `python -m convert SRC_DIR DST_DIR`."""

from convert.hf_layout import CheckpointError, iter_params, key_map

__all__ = ["CheckpointError", "convert", "iter_params", "key_map"]


def convert(src, dst, dtype: str = "bfloat16"):
    """Convert the HF snapshot directory `src` into our checkpoint at `dst` (atomically)."""
    import json
    from pathlib import Path

    from acache_jax.checkpoint import progress, save, check_destination
    from acache_jax.config import ModelConfig
    from convert.hf_layout import NUMPY_DTYPES

    src, dst = Path(src), Path(dst)
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(NUMPY_DTYPES)}, got {dtype!r}")
    check_destination(dst.absolute())
    cfg = ModelConfig.from_file(src)
    hf_config = json.loads((src / "config.json").read_text())
    params = iter_params(src, cfg, NUMPY_DTYPES[dtype], progress(f"converting {src.name}"))
    return save(dst, hf_config, params, dtype, tokenizer_dir=src)

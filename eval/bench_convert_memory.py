"""Peak memory of `python -m convert` on a synthetic LLaDA-shaped checkpoint of over 1B parameters.

    python -m eval.bench_convert_memory [--workdir DIR] [--layers 16]

Writes a random bf16 checkpoint in the HF LLaDA layout (sharded, with an index) to a temporary
directory, converts it in a child process and reports the child's peak RSS against the bound
"output size + two of its largest tensors", and against the RSS of merely importing the converter.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

GB = 1e9


def llada_shaped_config(layers: int) -> dict:
    return {
        "model_type": "llada", "d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "n_layers": layers,
        "mlp_hidden_size": 5632, "vocab_size": 126464, "embedding_size": 126464,
        "max_sequence_length": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081,
        "weight_tying": False, "include_bias": False, "include_qkv_bias": False, "torch_dtype": "bfloat16",
    }


def write_synthetic(directory: Path, cfg: dict) -> tuple[int, int]:
    """Write one shard per layer (plus one for embeddings); returns (total bytes, largest tensor bytes)."""
    rng = np.random.default_rng(0)
    d, f, v = cfg["d_model"], cfg["mlp_hidden_size"], cfg["embedding_size"]
    rand = lambda *shape: rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
    shards = [{"model.transformer.wte.weight": rand(v, d), "model.transformer.ff_out.weight": rand(v, d),
               "model.transformer.ln_f.weight": rand(d)}]
    weight_map, total, largest = {}, 0, 0
    for i in range(-1, cfg["n_layers"]):
        if i >= 0:
            b = f"model.transformer.blocks.{i}."
            shards = [{b + "attn_norm.weight": rand(d), b + "ff_norm.weight": rand(d),
                       b + "q_proj.weight": rand(d, d), b + "k_proj.weight": rand(d, d),
                       b + "v_proj.weight": rand(d, d), b + "attn_out.weight": rand(d, d),
                       b + "ff_proj.weight": rand(f, d), b + "up_proj.weight": rand(f, d),
                       b + "ff_out.weight": rand(d, f)}]
        tensors = shards.pop()
        name = f"model-{i + 2:05d}-of-{cfg['n_layers'] + 1:05d}.safetensors"
        save_file(tensors, str(directory / name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
        largest = max([largest] + [t.nbytes for t in tensors.values()])
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(cfg))
    return total, largest


def peak_rss_of(cmd: list[str]) -> tuple[float, str]:
    """Run cmd as the only child of a fresh helper process; return its peak RSS in bytes."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); print(r.returncode); "
             "print(r.stderr[-2000:], file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    rss, code = out.stdout.split()[:2]
    if code != "0":
        raise RuntimeError(f"{cmd} failed: {out.stderr}")
    return float(rss), out.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src, dst = Path(tmp) / "hf", Path(tmp) / "converted"
        src.mkdir()
        cfg = llada_shaped_config(args.layers)
        total, largest = write_synthetic(src, cfg)
        from acache_jax.network.config import ModelConfig

        params = ModelConfig.from_hf(cfg).num_params
        baseline, _ = peak_rss_of([sys.executable, "-c", "import convert.__main__, orbax.checkpoint"])
        peak, _ = peak_rss_of([sys.executable, "-m", "convert", str(src), str(dst), "--dtype", "bfloat16"])
        bound = total + 2 * largest
        print(f"parameters            {params / 1e9:.3f} B ({total / GB:.3f} GB bf16)")
        print(f"largest tensor        {largest / GB:.3f} GB")
        print(f"bound (out + 2 * max) {bound / GB:.3f} GB")
        print(f"import-only RSS       {baseline / GB:.3f} GB")
        print(f"convert peak RSS      {peak / GB:.3f} GB  ({peak / bound:.2f} x bound; "
              f"{(peak - baseline) / bound:.2f} x bound above the import baseline)")


if __name__ == "__main__":
    main()

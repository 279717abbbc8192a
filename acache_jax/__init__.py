"""acache-jax: affix-cache inference for diffusion LLMs (LLaDA, Dream) in JAX.

The public API: `load` a model, `build_affix_cache` once per shared affix, `acache_jax.decode.generate`
(the static, jitted path; `acache_jax.generate` is the command line) or `Engine` (continuous
batching) with a `DecodeConfig` (`model.decode_config(...)` starts from the model's generation
defaults), requests as `Request`s. `make_mesh` + `load(..., mesh=)` split a model over devices.
"""

from acache_jax.kv import AffixCache, KVPool
from acache_jax.acache import build_affix_cache
from acache_jax.checkpoint import load
from acache_jax.config import ConfigError, DecodeConfig, DecodeError, InputError, ModelConfig
from acache_jax.decode import GenerateResult
from acache_jax.engine import Engine, EngineResult
from acache_jax.layout import Request, RequestError
from acache_jax.model import ForwardOutput, Model, Transformer
from acache_jax.sharding import MeshError, make_mesh

__all__ = ["AffixCache", "ConfigError", "DecodeConfig", "DecodeError", "Engine", "EngineResult", "ForwardOutput",
           "GenerateResult", "InputError", "KVPool", "MeshError", "Model", "ModelConfig", "Request", "RequestError",
           "Transformer", "build_affix_cache", "load", "make_mesh"]

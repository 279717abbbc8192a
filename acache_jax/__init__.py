"""acache-jax: affix-cache inference for diffusion LLMs (LLaDA, Dream) in JAX."""

from acache_jax.attention import KVView
from acache_jax.acache import AffixCache, build_affix_cache
from acache_jax.checkpoint import load
from acache_jax.config import ConfigError, ModelConfig
from acache_jax.model import ForwardOutput, Model, Transformer

__all__ = ["AffixCache", "ConfigError", "ForwardOutput", "KVView", "Model", "ModelConfig", "Transformer",
           "build_affix_cache", "load"]

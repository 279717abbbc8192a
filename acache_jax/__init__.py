"""acache-jax: affix-cache inference for diffusion LLMs (LLaDA, Dream) in JAX."""

from acache_jax.attention import KVView
from acache_jax.checkpoint import load
from acache_jax.config import ConfigError, ModelConfig
from acache_jax.model import ForwardOutput, Model, Transformer

__all__ = ["ConfigError", "ForwardOutput", "KVView", "Model", "ModelConfig", "Transformer", "load"]

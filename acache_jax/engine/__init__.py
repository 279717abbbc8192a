"""Serving engine: a paged KV pool shared by many requests, with reference-counted affix blocks.

Host-side bookkeeping (plain Python/numpy) lives in `block_manager`, `sequence` and `scheduler`;
device work runs in the jitted steps of `runner`; `engine.Engine` drives them (schedule -> run ->
postprocess).
"""

from acache_jax.engine.engine import ENGINE_POLICIES, Engine, EngineResult, EngineStats
from acache_jax.engine.scheduler import RequestTooLargeError

__all__ = ["ENGINE_POLICIES", "Engine", "EngineResult", "EngineStats", "RequestTooLargeError"]

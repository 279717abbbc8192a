"""An OpenAI-compatible HTTP server over the engine, with online affix discovery
(`python -m acache_jax.serve`; see README "Serving").

cli: the flags and start-up; protocol: request bodies -> checked Jobs, results -> OpenAI objects;
worker: the engine thread; app: the FastAPI routes. FastAPI and uvicorn come with the `serve` extra
(imported only when the server starts).
"""

from acache_jax.serve.cli import main, parser

__all__ = ["main", "parser"]

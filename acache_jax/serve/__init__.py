"""An OpenAI-compatible HTTP server over the engine, with online affix discovery
(`python -m acache_jax.serve`; see README "Serving").

protocol: request bodies -> checked Jobs, results -> OpenAI objects; worker: the engine thread;
app: the FastAPI routes. FastAPI and uvicorn come with the `serve` extra.
"""

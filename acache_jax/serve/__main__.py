"""`python -m acache_jax.serve`: the server's command line (acache_jax/serve/cli.py)."""

import sys

from acache_jax.serve.cli import main

sys.exit(main())

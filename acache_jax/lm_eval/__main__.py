"""`python -m acache_jax.lm_eval`: lm-eval's command line with this model registered."""

import sys

from acache_jax.lm_eval import main

sys.exit(main())

"""GPU kernels (Pallas, Triton lowering) and their pure-jnp oracles."""

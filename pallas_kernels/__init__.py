"""GPU kernels (Pallas, Triton lowering) and their pure-jnp oracles."""

from pallas_kernels.gathered_attention import (BACKENDS, MASK_VALUE, anchor_importance, gathered_attention,
                                               merge_partials, rope, supported_on_gpu)

__all__ = ["BACKENDS", "MASK_VALUE", "anchor_importance", "gathered_attention", "merge_partials", "rope",
           "supported_on_gpu"]

"""Pallas kernels of snapmla-jax, each file one kernel beside its pure-jnp reference.

Users call them through ``snapmla_jax`` (``write_kv``, ``mla_decode``), which
validates arguments and picks the backend, or through the model (``models.moe``'s
gathered dispatch runs ``grouped_experts``).
"""

"""Benchmarks: ``python -m snapmla_jax.bench decode|write|e2e``. Run them on a GPU."""

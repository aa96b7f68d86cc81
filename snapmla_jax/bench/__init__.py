"""Benchmarks: ``python -m snapmla_jax.bench decode|ragged|write|e2e`` (``snapmla-bench``). Run
them on a GPU (``e2e --tiny`` and ``write --backends interpret xla`` run anywhere). Results go to
``--out``, or to ``snapmla_jax.cli.default_bench_dir()``; ``--publish`` replaces the published
tables in docs/benchmarks/."""

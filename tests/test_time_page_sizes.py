"""tools/time_page_sizes.py on the CPU: its re-paged caches hold the same tokens (the XLA path gives
the same attention through them), and without a GPU it exits 2 and writes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.bench import decode as bench_decode
from snapmla_jax.decode import mla_decode
from script_loader import load_script

tool = load_script("time_page_sizes", "tools")


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_repaged_caches_hold_the_same_tokens(dtype, layers):
    """Each page size's cache and table, read at every row's own length (a partial last page), give
    the bits the 64-token pages give: the same tokens in the same order (the XLA path of the
    Mosaic kernels' math gathers tokens and rounds P' per 128 of them whatever the page size, so
    nothing but the addressing differs)."""
    batch, context = 3, 256
    fp8, bf16, table = bench_decode.make_caches(batch, context, layers=layers)
    cache = fp8 if dtype == "fp8" else bf16
    q, q_rope, _, scale = bench_decode.make_queries(batch, context, 16, 1)
    seq_lens = jnp.asarray([256, 77, 1], jnp.int32)
    layer = None if layers == 1 else 1
    run = lambda c, t: np.asarray(mla_decode(q, q_rope, c, t, seq_lens, softmax_scale=scale, layer=layer,
                                             backend="xla").astype(jnp.float32))
    want = run(cache, table)
    for size in (32, 16):
        paged, paged_table = tool.repaged(cache, table, size)
        assert paged.page_size == size and paged_table.shape == (batch, context // size)
        np.testing.assert_array_equal(run(paged, paged_table), want)
    shuffled = jnp.asarray(np.random.default_rng(0).permutation(np.asarray(table).reshape(-1)).reshape(table.shape))
    with pytest.raises(AssertionError):  # the check sees a wrong order of pages
        np.testing.assert_array_equal(run(*tool.repaged(cache, shuffled, 16)), want)


def test_without_a_gpu_it_exits_2_and_writes_nothing(tmp_path, capsys):
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present")
    assert tool.main(["--out", str(tmp_path / "out"), "1x1024x16x1"]) == 2
    assert not (tmp_path / "out").exists()
    assert "time_page_sizes" in capsys.readouterr().err


def test_a_malformed_shape_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["8x4096x16"])
    assert exit_info.value.code == 2
    assert "BxCTXxHxSQ" in capsys.readouterr().err

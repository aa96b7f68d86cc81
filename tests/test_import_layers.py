"""The package's layers point one way: kernels <- ops <- model <- application.

- ``pallas_kernels/`` (snapmla_jax.pallas_kernels) imports nothing of the package but itself.
- The op layer (cache, write_kv, mla_decode, quantization, ...) imports kernels, not the model.
- ``models/`` (snapmla_jax.models) imports the op layer and kernels, never the application
  layer (generate, CLIs, bench, fidelity, train_demo) nor the package's re-exports.
Read from the source with ``ast``, so a lazy import inside a function counts too.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNELS = "snapmla_jax.pallas_kernels"
MODELS = "snapmla_jax.models"
OPS = {f"snapmla_jax.{name}" for name in ("backend", "cache", "decode", "fp8_weights", "paging", "quant_report",
                                           "quantization", "write")}


def package_imports(path: pathlib.Path) -> set[str]:
    """The snapmla_jax modules ``path`` imports (``from snapmla_jax import x`` counts as
    ``snapmla_jax.x``; a bare ``import snapmla_jax`` as ``snapmla_jax``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "snapmla_jax"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "snapmla_jax":
            if node.module == "snapmla_jax":
                found |= {f"snapmla_jax.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return found


def allowed(module: str, layer: set[str] | tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in layer)


LAYERS = [
    ("pallas_kernels", (KERNELS,)),
    ("models", (KERNELS, MODELS, *OPS)),
    *((f"snapmla_jax/{op.split('.')[1]}.py", (KERNELS, *OPS)) for op in sorted(OPS)),
]


@pytest.mark.parametrize("where, layer", LAYERS, ids=[where for where, _ in LAYERS])
def test_imports_point_down_the_layers(where, layer):
    target = ROOT / where
    files = sorted(target.glob("*.py")) if target.is_dir() else [target]
    assert files, where
    wrong = {f"{path.relative_to(ROOT)}: {module}" for path in files for module in package_imports(path)
             if not allowed(module, layer)}
    assert not wrong, sorted(wrong)


def test_the_check_sees_a_lazy_import_of_the_application(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from snapmla_jax.generate import generate\n    import snapmla_jax\n")
    assert package_imports(module) == {"snapmla_jax.generate", "snapmla_jax"}
    assert not allowed("snapmla_jax.generate", (KERNELS, MODELS, *OPS))

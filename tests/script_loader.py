"""Loading the repository's scripts/ and tools/ files as modules in tests (they are not a package)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(name: str, folder: str = "scripts"):
    """``folder``/``name``.py (scripts/ or tools/), imported as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module

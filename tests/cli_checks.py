"""What the CLI tests check of a refused command: exit code 2, one line on stderr and no
Traceback (``usage_error``), and no file created, removed or changed (``tree_snapshot``)."""

import pathlib


def tree_snapshot(root: pathlib.Path) -> dict[str, tuple]:
    """Every file and directory under ``root``: relative path -> (kind, size, mtime_ns, bytes of a
    small file), to show that a command created, removed or changed nothing."""
    snapshot = {}
    for item in sorted(root.rglob("*")):
        stat = item.lstat()
        data = item.read_bytes() if item.is_file() and stat.st_size <= 1 << 16 else None
        snapshot[str(item.relative_to(root))] = ("dir" if item.is_dir() else "file", stat.st_size,
                                                  stat.st_mtime_ns, data)
    return snapshot


def assert_usage_error(code: int, err: str, needle: str = "") -> None:
    """A command refused its input as the CLIs promise: exit code 2, exactly one line on stderr,
    no Traceback, and ``needle`` in that line."""
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err

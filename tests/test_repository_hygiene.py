"""The repository's text says what the project is, not when it was done: no tracked text file
names work periods or tracker issues (the history is git's)."""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Work periods and tracker issues named in the text (``test_diary_lines_are_found`` has examples).
DIARY = re.compile(r"\bsessions?\b|\b(twenty|thirty|forty)[- ]?(first|second|third|fourth|fifth|sixth|seventh|eighth"
                   r"|ninth)\b|\b(twen|thir|for)tieth\b|\bissue\s+#?[0-9]+\b", re.IGNORECASE)
# The shipped demo model's checkpoint and recipe: data, not prose.
DATA = ("snapmla_jax/assets/",)


def diary_lines(path: str, text: str) -> list[str]:
    """"path:line: text" for each line of ``text`` that matches ``DIARY``."""
    return [f"{path}:{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), 1)
            if DIARY.search(line)]


def tracked_texts():
    """(path, text) of every tracked file that exists, is UTF-8 text and is not under ``DATA``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for path in filter(None, listed.decode().split("\0")):
        file = ROOT / path
        if path.startswith(DATA) or not file.is_file():
            continue
        data = file.read_bytes()
        if b"\0" in data:
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def test_diary_lines_are_found():
    # Each example is split so that this file does not match itself.
    period, issue = "the twen" + "tieth ses" + "sion", "see issue" + " #41"
    ordinal = "Until the twen" + "tieth, H=128 was slower"
    text = "\n".join(["Kernel comments say why.", period, "Measured in the thirty" + "-first run.", issue,
                      "the loss decays to a tenth; an issue of 3 tokens", ordinal])
    assert diary_lines("x.py", text) == [f"x.py:2: {period}", "x.py:3: Measured in the thirty" + "-first run.",
                                         f"x.py:4: {issue}", f"x.py:6: {ordinal}"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_tracked_text_is_a_diary():
    found = [line for path, text in tracked_texts() for line in diary_lines(path, text)]
    assert not found, f"{len(found)} lines name work periods or issues:\n" + "\n".join(found[:50])

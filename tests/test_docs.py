"""The documentation's relative links resolve inside the repository.

Pages: README.md and every docs/**/*.md. A link is a markdown link or image, inline
(``[text](target)``, ``![alt](target)``) or a reference definition (``[name]: target``),
outside code blocks and code spans. http(s) and mailto links and bare ``#anchor`` links are
not checked; an anchor or query after a path is ignored. A relative target must name a file
or folder that exists inside the repository.
"""

import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

FENCED_BLOCK = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")



def doc_pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def link_targets(markdown: str) -> list[str]:
    """Every link and image target of a markdown text, code blocks and code spans left out."""
    prose = CODE_SPAN.sub("", FENCED_BLOCK.sub("", markdown))
    return INLINE_LINK.findall(prose) + REFERENCE_DEFINITION.findall(prose)


def broken_links(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """The relative link targets of ``page`` that name nothing inside ``root``."""
    broken = []
    for target in link_targets(page.read_text(encoding="utf-8")):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = urllib.parse.unquote(target.split("#", 1)[0].split("?", 1)[0])
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(page):
    assert broken_links(page) == []


def test_the_link_check_reports_broken_links_and_images(tmp_path):
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    (tmp_path / "docs" / "benchmarks" / "decode.md").write_text("# table\n")
    (tmp_path / "docs" / "plot.png").write_bytes(b"")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[table](benchmarks/decode.md#h-128) and ![plot](plot.png) resolve;\n"
        "[gone](benchmarks/mgpu.md), ![lost](missing.png) and [out](../../outside.md) do not.\n"
        "[web](https://example.com/x.md), [here](#section) and `[code](nowhere.md)` are not checked.\n"
        "```\n[block](nowhere_either.md)\n```\n"
        "[ref]: benchmarks/absent.json\n")
    assert broken_links(page, root=tmp_path) == ["benchmarks/mgpu.md", "missing.png", "../../outside.md",
                                                 "benchmarks/absent.json"]

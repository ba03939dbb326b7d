"""The code blocks of the user-facing docs, read from the files themselves (never from a copy),
for `test_docs_examples.py`.

In README.md and the pages of DOCS under docs/ every fenced code block is one of:
  - an example a test runs: `<!-- example: NAME -->` on the line right before its fence;
  - an example that cannot be run here: a visible line "Untested here: WHY" in the prose
    between the previous block and this one;
  - an illustration (a diagram, a directory layout): a `text` block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/clients.md", "docs/leases.md", "docs/operations.md", "docs/gateway.md",
        "docs/configuration.md", "docs/errors.md", "docs/security.md")

# The addresses the docs use, those of the shipped config/fencegate.toml.
DOC_S3_ADDR = "127.0.0.1:9000"
DOC_ADMIN_ADDR = "127.0.0.1:9001"

_FENCE_RE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+.-]*)\s*$")
_MARKER_RE = re.compile(r"^\s*<!-- example: ([\w.-]+) -->\s*$")
_UNTESTED_RE = re.compile(r"untested here:\s*(.*?)\s*(?:\*|$)", re.I | re.S)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    name: str | None  # the example marker, if any
    untested: str | None  # the reason given, if any

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    """Every fenced code block of `doc` (a path relative to the repository), in order."""
    lines = (REPO_ROOT / doc).read_text().splitlines()
    out: list[Block] = []
    prose: list[str] = []  # the lines since the previous block closed
    i = 0
    while i < len(lines):
        opening = _FENCE_RE.match(lines[i])
        if not opening:
            prose.append(lines[i])
            i += 1
            continue
        fence, lang = opening.group(1), opening.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        if end == len(lines):
            raise AssertionError(f"{doc}:{i + 1}: code block never closed")
        filled = [line for line in prose if line.strip()]
        marker = _MARKER_RE.match(filled[-1]) if filled else None
        untested = _UNTESTED_RE.search(" ".join(line.strip() for line in prose))
        out.append(Block(
            doc=doc,
            line=i + 1,
            lang=lang,
            code="\n".join(lines[i + 1:end]) + "\n",
            name=marker.group(1) if marker else None,
            untested=untested.group(1) if untested else None,
        ))
        prose = []
        i = end + 1
    return out


def block(doc: str, name: str) -> Block:
    """The block marked `<!-- example: NAME -->` in `doc`."""
    found = [b for b in blocks(doc) if b.name == name]
    assert len(found) == 1, f"{doc} has {len(found)} examples named {name!r}"
    return found[0]


def localize(code: str, s3_addr: tuple, admin_addr: tuple) -> str:
    """The example with the docs' addresses (those of the shipped config) replaced by a test
    instance's: the one change made to an example before it runs."""
    return code.replace(DOC_S3_ADDR, "%s:%d" % s3_addr).replace(DOC_ADMIN_ADDR, "%s:%d" % admin_addr)

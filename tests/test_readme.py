"""The README's "Equivalence test in Python" section runs as written, and prints what it shows."""

from __future__ import annotations

import contextlib
import io
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
SECTION = "## Equivalence test in Python"


def _blocks(section: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block of ``section``, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", section, re.S)]


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:] if end < 0 else text[start:end]


def test_equivalence_section_runs_and_prints_its_shown_output():
    with open(README, encoding="utf-8") as f:
        blocks = _blocks(_section(f.read(), SECTION))
    python = [i for i, (lang, _) in enumerate(blocks) if lang == "python"]
    assert len(python) >= 3, "the section lost its code blocks"
    namespace: dict = {"__name__": "readme"}
    for i in python:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(blocks[i][1], f"README.md block {i}", "exec"), namespace)
        shown = blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "" else None
        if shown is not None:
            assert out.getvalue() == shown, f"README block {i} printed:\n{out.getvalue()}"

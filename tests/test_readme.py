"""The README's promises about itself: it starts with the two set-up commands, and its contents list
names every section and points at real anchors (GitHub's: lower case, punctuation dropped, spaces to -).
`python tests/test_readme.py` rewrites the contents list after a section is added or renamed."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def headings(text: str) -> list[tuple[str, str]]:
    """(level marks, title) of every ## and ### heading outside code blocks, in order."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^(##|###) (.+)$", line)):
            out.append((m.group(1), m.group(2).strip()))
    return out


def anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


START, END = "<!-- contents -->", "<!-- /contents -->"


def contents(text: str) -> list[tuple[str, str, str]]:
    """(indent, title, anchor) of every section, as the contents list should name them; a repeated title's
    anchor gets GitHub's -1, -2, ... suffix."""
    seen: dict[str, int] = {}
    out = []
    for marks, title in headings(text):
        slug = anchor(title)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.append(("" if marks == "##" else "  ", title, f"{slug}-{n}" if n else slug))
    return out


def test_readme_starts_with_the_two_setup_commands():
    first = README.read_text().split("```")[1].splitlines()
    assert [line.split()[:2] for line in first if line.strip()] == [["make", "demo"], ["make", "test"]]


def test_the_contents_list_names_every_section_and_points_at_its_anchor():
    text = README.read_text()
    block = text.split(START)[1].split(END)[0]
    listed = re.findall(r"^( *)- \[(.+)\]\(#([^)]+)\)$", block, flags=re.M)
    assert listed == contents(text), "the README's contents list is stale: run python tests/test_readme.py"


if __name__ == "__main__":
    text = README.read_text()
    lines = "\n".join(f"{indent}- [{title}](#{slug})" for indent, title, slug in contents(text))
    head, rest = text.split(START, 1)
    README.write_text(f"{head}{START}\n**Contents**\n\n{lines}\n{END}{rest.split(END, 1)[1]}")

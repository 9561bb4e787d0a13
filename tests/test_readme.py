"""The README's promises about itself: it starts with the two set-up commands, its contents list
names every section and points at real anchors (GitHub's: lower case, punctuation dropped, spaces to -),
and every `vlberts` command line in it and in docs/ names settings, models and architectures that exist.
`python tests/test_readme.py` rewrites the contents list after a section is added or renamed."""

import dataclasses
import importlib
import re
from pathlib import Path

import typer.main

from vlberts import cli
from vlberts.models.builders import ARCHS, MODEL_CONFIGS

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))


def headings(text: str, marks: str = "##|###") -> list[tuple[str, str]]:
    """(level marks, title) of every heading of the levels `marks` (a regex: ## and ### by default) outside
    code blocks, in order."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(rf"^({marks}) (.+)$", line)):
            out.append((m.group(1), m.group(2).strip()))
    return out


def anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


START, END = "<!-- contents -->", "<!-- /contents -->"


def anchors(titles: list[str]) -> list[str]:
    """GitHub's anchors of these headings, in order: a repeated title's gets a -1, -2, ... suffix."""
    seen: dict[str, int] = {}
    out = []
    for title in titles:
        slug = anchor(title)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.append(f"{slug}-{n}" if n else slug)
    return out


def contents(text: str) -> list[tuple[str, str, str]]:
    """(indent, title, anchor) of every section, as the contents list should name them."""
    found = headings(text)
    return [("" if marks == "##" else "  ", title, slug)
            for (marks, title), slug in zip(found, anchors([title for _, title in found]))]


def test_readme_starts_with_the_two_setup_commands():
    first = README.read_text().split("```")[1].splitlines()
    assert [line.split()[:2] for line in first if line.strip()] == [["make", "demo"], ["make", "test"]]


def test_the_contents_list_names_every_section_and_points_at_its_anchor():
    text = README.read_text()
    block = text.split(START)[1].split(END)[0]
    listed = re.findall(r"^( *)- \[(.+)\]\(#([^)]+)\)$", block, flags=re.M)
    assert listed == contents(text), "the README's contents list is stale: run python tests/test_readme.py"


def broken_links(doc: Path) -> list[str]:
    """Every relative link in `doc` (outside code blocks) whose file does not exist, or whose #anchor is no
    heading of that file (any level); web links are not followed."""
    wrong, in_code = [], False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        for target in [] if in_code else re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, slug = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                wrong.append(f"{doc.name}:{number}: {target}: no such file")
            elif slug and dest.suffix == ".md" and slug not in anchors(
                    [title for _, title in headings(dest.read_text(), "#{1,6}")]):
                wrong.append(f"{doc.name}:{number}: {target}: no such heading")
    return wrong


def test_every_link_in_the_readme_and_docs_reaches_a_file_and_heading(tmp_path):
    wrong = [w for doc in (README, *DOCS) for w in broken_links(doc)]
    assert not wrong, "\n".join(wrong)
    # The check finds a moved heading and a missing file.
    (tmp_path / "other.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section), [ok](#here), [web](https://example.org/x#y)\n"
                    "```\n[in code](gone.md)\n```\n## Here\n[moved](other.md#old-name) [gone](gone.md)\n")
    assert broken_links(page) == ["page.md:6: other.md#old-name: no such heading", "page.md:6: gone.md: no such file"]


# A `vlberts` invocation in prose or a code block: the command itself, `.venv/bin/vlberts`, or
# `python -m vlberts.cli` under torchrun; what follows it up to the end of the line or the code span.
INVOCATION = re.compile(r"(?:^|[\s`$(/])vlberts(?:\.cli)?[ \t]+((?:[^\n`\\]|\\\n|\\)*)", flags=re.M)


def invocations(text: str) -> list[tuple[int, list[str], str]]:
    """(line number, subcommand path, the rest of the line) of every `vlberts` command line in `text` that
    names a command (not a group, not the word in a sentence), backslash continuations joined."""
    root, out = typer.main.get_command(cli.app), []
    for m in INVOCATION.finditer(text):
        cmd, path, words = root, [], m.group(1).replace("\\\n", " ").split()
        while words and words[0] in getattr(cmd, "commands", {}):
            cmd = cmd.commands[words.pop(0)]
            path.append(cmd.name)
        if path and not hasattr(cmd, "commands"):
            rest = re.split(r"\s[;|&#]|\s>", " " + " ".join(words))[0]  # up to a shell separator or comment
            out.append((text[: m.start(1)].count("\n") + 1, path, rest))
    return out


def settings_of(path: list[str]) -> set[str]:
    """The `--` names command `path` takes: its own options and, for a run-config command, every field of
    its recipe's config (the names `vlberts show-config` prints)."""
    cmd = typer.main.get_command(cli.app)
    for name in path:
        cmd = cmd.commands[name]
    names = {o[2:] for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    if cmd.context_settings.get("allow_extra_args"):  # --key=value overrides of a run config
        module = importlib.import_module(cli.SHOW["-".join(path).replace("_", "-")])
        names |= {f.name for f in dataclasses.fields(module.CONFIG_CLASS)}
    return names


def placeholder(value: str) -> bool:
    """A value the text leaves to the reader (NAME, A,B,..., {arch}, $ARCH, lxmert-*) or a path."""
    return not value or any(c.isupper() or c in "{}$<>.[*/" for c in value)


def test_every_command_line_in_the_readme_and_docs_names_real_settings():
    checked, wrong = 0, []
    for doc in (README, *DOCS):
        for line, path, rest in invocations(doc.read_text()):
            known = settings_of(path)
            for name, value in re.findall(r"(?<![\w-])--([A-Za-z][\w-]*)(?:=(\S*))?", rest):
                checked += 1
                where = f"{doc.name}:{line}: vlberts {' '.join(path)} --{name}"
                if name != "help" and name not in known:
                    wrong.append(f"{where}: no such setting")
                elif name == "model" and not placeholder(value) and value not in MODEL_CONFIGS:
                    wrong.append(f"{where}={value}: no such model")
                elif name in ("arch", "archs") and not placeholder(value) and set(value.split(",")) - set(ARCHS):
                    wrong.append(f"{where}={value}: no such architecture")
    assert checked > 400, checked  # the pattern still finds the command lines
    assert not wrong, "\n".join(wrong)


def test_a_misspelt_setting_in_a_command_line_is_found():
    text = "run `vlberts pretrain --config=X --stesp=10` and\n```\nvlberts demo --arch=visualbert \\\n    --qucik\n```"
    found = [(line, path, re.findall(r"--(\w+)", rest)) for line, path, rest in invocations(text)]
    assert found == [(1, ["pretrain"], ["config", "stesp"]), (3, ["demo"], ["arch", "qucik"])]
    assert "stesp" not in settings_of(["pretrain"]) and {"config", "steps"} <= settings_of(["pretrain"])
    assert {"arch", "quick"} <= settings_of(["demo"]) and "qucik" not in settings_of(["demo"])


# A pointer from code to a section: (README, "Title") or docs/page.md, "Title", in a comment or in a
# help string (quotes escaped); the title may be cut where a string literal breaks, so it is a prefix.
SECTION_REFERENCE = re.compile(r"""(README|docs/[\w.-]+\.md)(?:'s)?,? \\?"([^"\\]+)""")


def section_references(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in SECTION_REFERENCE.finditer(text)]


def test_every_section_the_code_points_to_exists():
    root, wrong, checked = README.parent, [], 0
    for path in sorted((*root.glob("src/**/*.py"), *root.glob("benchmarks/*.py"), *root.glob("tests/*.py"))):
        for page, title in section_references(path.read_text()):
            if path.name == "test_readme.py":
                continue
            checked += 1
            titles = [t for _, t in headings((root / (page if page.endswith(".md") else "README.md")).read_text(), "#+")]
            if not any(t.startswith(title) for t in titles):
                wrong.append(f"{path.relative_to(root)}: {page}, {title!r}: no such section")
    assert checked > 10, checked  # the pattern still finds the pointers
    assert not wrong, "\n".join(wrong)
    # The pattern reads both forms, and a title cut at a broken string literal as its start.
    code = 'x  # (README, "The world\'s vocabulary")\nhelp="... (docs/pretraining.md, \\"Masked "\n'
    assert section_references(code) == [("README", "The world's vocabulary"), ("docs/pretraining.md", "Masked ")]


if __name__ == "__main__":
    text = README.read_text()
    lines = "\n".join(f"{indent}- [{title}](#{slug})" for indent, title, slug in contents(text))
    head, rest = text.split(START, 1)
    README.write_text(f"{head}{START}\n**Contents**\n\n{lines}\n{END}{rest.split(END, 1)[1]}")

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


if __name__ == "__main__":
    text = README.read_text()
    lines = "\n".join(f"{indent}- [{title}](#{slug})" for indent, title, slug in contents(text))
    head, rest = text.split(START, 1)
    README.write_text(f"{head}{START}\n**Contents**\n\n{lines}\n{END}{rest.split(END, 1)[1]}")

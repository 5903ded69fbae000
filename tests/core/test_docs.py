"""The README and docs/ stay true: short README, links that resolve, no stale references, every
command and option documented, and the README's console output what the commands print."""

import argparse
import re
from pathlib import Path

import pytest

from ampbridge.cli.commands import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_readme_is_a_five_minute_read():
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path) if path else page
        assert resolved.exists(), f"{page.name}: link to {target} resolves to nothing"
        if anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.name}: no heading for #{anchor} in {path}"


def test_no_reference_to_a_missing_design_file_or_an_issue_number():
    sources = [*PAGES, *(ROOT / "ampbridge").rglob("*.py"), *(ROOT / "examples").glob("*")]
    for path in sources:
        text = path.read_text()
        assert "DESIGN.md" not in text, f"{path.relative_to(ROOT)} cites DESIGN.md, which the repository lacks"
        found = re.search(r"\bissues? #?\d+", text, re.I)
        assert not found, f"{path.relative_to(ROOT)} cites {found.group(0)!r}: say what it is instead"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(LINK.findall(index))
    missing = [p.name for p in DOCS if p.name != "README.md" and p.name not in linked]
    assert not missing, f"docs/README.md does not link {missing}"


def test_cli_md_documents_every_command_and_option():
    cli = (ROOT / "docs" / "cli.md").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    undocumented = {}
    for name, parser in sub.choices.items():
        row = re.search(rf"^\| `{name}\b[^\n]*", cli, re.M)
        assert row, f"docs/cli.md has no row for `ampbridge {name}`"
        # an option is documented by any of its spellings (`-o OUT` for --output)
        lacking = sorted(a.option_strings[-1] for a in parser._actions if a.option_strings and a.dest != "help"
                         and not any(re.search(rf"{o}\b", row.group(0)) for o in a.option_strings))
        if lacking:
            undocumented[name] = lacking
    assert not undocumented, f"docs/cli.md's rows lack these options: {undocumented}"


def _console(text: str, command: str) -> list[str]:
    """The lines the README shows under ``$ COMMAND``, up to the next prompt or the block's end."""
    for block in _blocks(text, "console"):
        lines = block.splitlines()
        if f"$ {command}" in lines:
            shown = lines[lines.index(f"$ {command}") + 1:]
            return shown[:next((i for i, line in enumerate(shown) if line.startswith("$ ")), len(shown))]
    raise AssertionError(f"the README shows no `$ {command}`")


def _in_order(shown: list[str], printed: list[str]) -> None:
    """Every shown line, ``...`` skipped, is a printed line, in the printed order."""
    rest = iter(printed)
    for line in shown:
        if line != "...":
            assert any(p == line for p in rest), f"{line!r} is not printed (in this order)"


def test_readme_init_and_show_print_what_the_readme_shows(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    monkeypatch.chdir(tmp_path)
    assert main(["init"]) == 0
    assert capsys.readouterr().out.splitlines() == _console(text, "ampbridge init")
    assert main(["show", "amp.toml"]) == 0
    _in_order(_console(text, "ampbridge show amp.toml"), capsys.readouterr().out.splitlines())

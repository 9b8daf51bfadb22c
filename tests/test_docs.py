"""The README is the front door and docs/ the site (mkdocs.yml): the README stays short and keeps the set-up and
test commands CI runs, every relative link in it and in docs/ reaches a file, and every page is in the nav.
CI builds the site itself (`mkdocs build --strict` in .ci/run), which also checks anchors."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    links = []
    for target in LINK.findall(text):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        links.append(target.split("#", 1)[0])
    return links


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_readme_is_a_short_front_door_with_the_set_up_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "./install.sh test" in readme
    assert "python -m pytest -q" in readme  # the command .ci/run runs
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_every_relative_link_reaches_a_file():
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for path in files:
        for target in _relative_links(path):
            if target and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken
    assert len(_relative_links(ROOT / "README.md")) >= 10  # the parser does find the README's links


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs" and config["strict"] is True
    nav = _nav_pages(config["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(set(nav)) == pages
    assert all((DOCS / page).is_file() for page in nav)


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block; an unclosed fence is an error of the page."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and language is None:
            language, lines = fence.group(1), []
        elif fence:
            assert not fence.group(1), f"a ``` fence opens inside a {language or 'plain'} block: {line!r}"
            blocks.append((language, "\n".join(lines)))
            language = None
        elif language is not None:
            lines.append(line)
    assert language is None, "a fenced block is never closed"
    return blocks


def test_every_python_example_in_the_readme_and_docs_is_python():
    """Copy-paste is how the examples are used: each ```python block compiles (``...`` stands for the reader's
    code, which Python reads as a value), and the fences pair up."""
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for language, code in _fenced_blocks(path.read_text()):
            if language in ("python", "py"):
                import textwrap

                try:
                    compile(textwrap.dedent(code), str(path), "exec")
                except SyntaxError as e:
                    raise AssertionError(f"{path.name}: a python block does not compile: {e}\n{code[:300]}") from e

"""docs/ (and the README's links) kept true: commands that parse, links that resolve, modules that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from batchgen.cli import app
from tests.test_readme import README, ROOT, code_commands

DOCS = sorted((ROOT / "docs").glob("*.md"))
# the pages whose links are checked: the README, docs/ and the benchmarks' index and records
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
LINKED = [ROOT / "README.md", *DOCS, ROOT / "benchmarks" / "README.md", *RESULTS]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MODULE_PATH = re.compile(r"\bbatchgen/[\w/]+\.(?:py|c|h)\b")
CSRC = ROOT / "batchgen" / "engine" / "kernels" / "csrc"
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
C_PATH = re.compile(r"(?<![<\w/.])((?:\w+/)*\w+\.(?:py|c|h|md))\b")  # not a <system.h>


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_is_a_page_not_a_notebook():
    assert len(README.splitlines()) <= 300


def test_docs_has_its_pages():
    names = {p.name for p in DOCS}
    assert {"README.md", "options.md", "output-and-resume.md", "performance.md", "gpu.md", "quantization.md",
            "sharding.md", "monitoring.md", "openai-batch.md", "models.md"} <= names, names


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=rel)
def test_reference_not_history(page):
    text = page.read_text(encoding="utf-8")
    for narrative in (r"History:", r"\b\w+th stop\b", r"\bthis stop\b", r"\bprevious stop\b"):
        assert not re.search(narrative, text), (rel(page), narrative)


def doc_commands() -> list[tuple[str, list[str]]]:
    return [(rel(page), words) for page in DOCS for words in code_commands(page.read_text(encoding="utf-8"))]


def test_docs_show_commands():
    assert len(doc_commands()) >= 10


@pytest.mark.parametrize(("page", "words"), doc_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v[:3]))
def test_every_docs_command_parses(page, words):
    """Parsed by the real CLI (flags, their values' types, arguments), without running anything."""
    group = typer.main.get_command(app)
    assert words[1] in group.commands, (page, words)
    command = group.commands[words[1]]
    try:
        command.make_context(words[1], list(words[2:]))
    except Exception as e:  # typer's own click: NoSuchOption, BadParameter, MissingParameter, ...
        pytest.fail(f"{page}: {' '.join(words)}: {type(e).__name__}: {getattr(e, 'format_message', e.__str__)()}")


def slugs(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    out = set()
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # a `# comment` is no heading
    for title in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def links() -> list[tuple[Path, str]]:
    found = []
    for page in LINKED:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        found += [(page, target) for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]
    return found


def test_pages_link_to_each_other():
    assert len(links()) >= 30


@pytest.mark.parametrize(("page", "target"), links(), ids=lambda v: rel(v) if isinstance(v, Path) else v)
def test_every_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.is_file(), f"{rel(page)}: {target} is not a file"
    if anchor and dest.suffix == ".md":
        assert anchor in slugs(dest), f"{rel(page)}: {target}: no heading with that anchor"


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=rel)
def test_every_module_path_named_exists(page):
    named = set(MODULE_PATH.findall(page.read_text(encoding="utf-8")))
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, (rel(page), missing)


@pytest.mark.parametrize("source", sorted(CSRC.glob("*.[ch]")), ids=lambda p: p.name)
def test_every_path_a_c_comment_names_exists(source):
    """A path with folders is the repository's, the package's (`engine/...`) or kernels/'s (`csrc/...`);
    a bare file name is a csrc/ or kernels/ file, or one the same file named with its folders."""
    named = {p for comment in C_COMMENT.findall(source.read_text(encoding="utf-8")) for p in C_PATH.findall(comment)}
    known = {p.rpartition("/")[2] for p in named if "/" in p}
    bases = (ROOT, ROOT / "batchgen", CSRC.parent, CSRC)
    missing = sorted(p for p in named if not any((base / p).is_file() for base in bases)
                     and ("/" in p or p not in known))
    assert not missing, (rel(source), missing)


def cli_flags() -> set[str]:
    """Every flag of every command, both halves of an on/off pair."""
    flags = set()
    for command in typer.main.get_command(app).commands.values():
        for param in command.params:
            flags.update(o for o in (*param.opts, *getattr(param, "secondary_opts", ())) if o.startswith("--"))
    return flags


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=rel)
def test_every_flag_in_an_option_table_exists(page):
    """The first cell of a table row that names flags (`--mode`, `--chat/--no-chat`) names real ones."""
    known = cli_flags()
    rows = re.findall(r"^\| `(--[^|]*)\|", page.read_text(encoding="utf-8"), flags=re.M)
    named = {f for cell in rows for f in re.findall(r"--[a-z][a-z0-9-]*", cell)}
    assert not named - known, (rel(page), sorted(named - known))

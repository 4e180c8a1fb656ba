"""The manual says what the code is: its links, paths and commands all exist.

Checks ``README.md`` (under 200 lines) and ``docs/*.md``, reading only files (no
network, no model; the CLI's option lists come from importing ``meshserve.cli``):

* every relative Markdown link leads to a file, and a ``#fragment`` to a heading;
* every repo path named in code (a word of an inline code span or of a fenced
  block that ends in ``.py .md .proto .yml .yaml .toml .sh``, is a folder ending
  in ``/``, or lies under a top folder such as ``tests/``) exists: from the repo
  root when it has a ``/``, else as the name of some file or folder of the tree;
  ``*`` and ``{a,b}`` must each match something.
  A word right after a ``--flag`` is that flag's value (a user's file), not a path;
  report folders that only a make target creates are listed in ``GENERATED``;
* every ``make TARGET`` is a target of the Makefile;
* every ``python -m MODULE`` of the project is a module file, and each ``--flag``
  after it occurs quoted in that module's source;
* every ``meshserve COMMAND`` is a command of the CLI and each ``--flag`` after it
  one of that command's options; any other ``--flag`` in a code span is an option
  of some command, or occurs quoted in ``meshserve/`` or in the Makefile.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200

PATH_SUFFIXES = (".py", ".md", ".proto", ".yml", ".yaml", ".toml", ".sh")
PROJECT_PACKAGES = ("meshserve", "gateway", "scheduler", "executor", "kvstore", "tests")
# A word under one of these folders is a repo path whatever its ending (``tests/mesh``).
TOP_FOLDERS = (*PROJECT_PACKAGES, "docs", "deploy", "protos", "reports")
SKIPPED_DIRS = {"__pycache__", "node_modules"}
# Paths the manual names that a make target writes, not the repository (path → target).
GENERATED = {"reports/batching/": "bench-batching", "reports/summary.md": "bench-compare"}

# [text](target) and ![alt](target); the target stops at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


def doc_files() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def split_fences(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, lines inside fenced code blocks) of a Markdown text."""
    prose, code, in_fence = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
        elif in_fence:
            code.append(line)
        else:
            prose.append(line)
    return prose, code


def prose_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks (links in code are not links)."""
    return split_fences(text)[0]


def code_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text (outside fenced blocks), in order.
    A span may run over a line break, as in Markdown."""
    prose = "\n".join(prose_lines(text))
    return [span.replace("\n", " ").strip() for span in re.findall(r"`([^`]+)`", prose)]


def commands(text: str) -> list[str]:
    """Code to read as commands: each inline code span, and each line of the fenced
    blocks with ``\\`` continuations joined and ``#`` comments dropped."""
    joined, pending = [], ""
    for line in split_fences(text)[1]:
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    return code_spans(text) + joined


def links(text: str) -> list[str]:
    """Relative link targets of a Markdown text, in order (code spans and blocks skipped)."""
    out = []
    for line in prose_lines(text):
        line = re.sub(r"`[^`]*`", "", line)
        out += [t for t in LINK.findall(line) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Anchors of every heading of a Markdown file."""
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            found.add(slug(m.group(1)))
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that lead nowhere, each as ``target: why``."""
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target}: no heading #{fragment} in {dest.name}")
    return broken


# -- repo paths -----------------------------------------------------------------


def looks_like_repo_path(word: str) -> bool:
    """A word that names a file or folder of the repository (not a URL, a home or
    absolute path, a variable or a placeholder)."""
    if not word or word[0] in "~$/." or "://" in word or any(c in word for c in "…<>()=|"):
        return False
    return (word.endswith(PATH_SUFFIXES) or (word.endswith("/") and len(word) > 1)
            or ("/" in word and word.split("/")[0] in TOP_FOLDERS))


def path_words(command: str) -> list[str]:
    """Words of a command or span that look like repo paths; a ``--flag``'s value is skipped."""
    out, after_flag = [], False
    for raw in command.split():
        word = raw.strip("[](),;:'\"").removesuffix("...")
        if not after_flag and looks_like_repo_path(word):
            out.append(word)
        after_flag = bool(FLAG.match(word.split("=")[0]))
    return out


def repo_paths(text: str) -> list[str]:
    """Repo paths named in a Markdown text's code (spans and fenced blocks), in order, once each."""
    return list(dict.fromkeys(w for command in commands(text) for w in path_words(command)))


def expand_braces(pattern: str) -> list[str]:
    """``a/{b,c}/d`` → ``a/b/d``, ``a/c/d`` (one level of braces, any number of groups)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def tree_names(root: Path) -> set[str]:
    """Names of every file and folder under ``root`` (hidden folders such as ``.venv``,
    caches and build output skipped, not walked): what a bare ``name.py`` or
    ``folder/`` may be."""
    names = set()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info"))]
        names.update(f"{d}/" for d in dirs)
        names.update(files)
    return names


def missing_paths(text: str, root: Path, names: set[str] | None = None) -> list[str]:
    """The repo paths of a Markdown text that do not exist under ``root``."""
    names = tree_names(root) if names is None else names
    missing = []
    for word in repo_paths(text):
        if word in GENERATED:
            continue
        for pattern in expand_braces(word):
            if "/" not in pattern.rstrip("/"):
                found = ("*" in pattern and any(Path(n).match(pattern) for n in names)) or pattern in names
            else:
                found = any(root.glob(pattern.rstrip("/"))) if "*" in pattern else (root / pattern).exists()
            if not found:
                missing.append(pattern)
    return missing


# -- commands -------------------------------------------------------------------


def makefile_targets(makefile: Path) -> set[str]:
    """The targets a Makefile defines (rules ``name:`` and ``.PHONY`` entries)."""
    text = makefile.read_text(encoding="utf-8")
    rules = re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.M)
    phony = [t for line in re.findall(r"^\.PHONY:(.*)$", text, flags=re.M) for t in line.split()]
    return set(rules) | set(phony)


def invocations(text: str, program: str) -> list[tuple[str, list[str]]]:
    """``(first argument, the words after it)`` of each ``program ARG ...`` in the text's code."""
    out = []
    for command in commands(text):
        words = command.split()
        for i, word in enumerate(words[:-1]):
            if word.split("/")[-1] == program:
                out.append((words[i + 1], words[i + 2:]))
    return out


def flags_of(words: list[str]) -> list[str]:
    """The ``--flags`` among words, in order (``[--a`` and ``--a=1`` give ``--a``)."""
    found = []
    for word in words:
        for part in word.strip("[]()").split("|"):
            flag = part.split("=")[0].strip("[]()")
            if FLAG.match(flag):
                found.append(flag)
    return found


def module_file(module: str, root: Path) -> Path | None:
    """The source of a ``python -m`` module of the project (a package runs its ``__main__``)."""
    path = root / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__main__.py"):
        if candidate.exists():
            return candidate
    return None


def cli_options() -> dict[str, set[str]]:
    """``meshserve`` command → its options (both forms of a ``--x/--no-x`` flag)."""
    import typer

    from meshserve.cli import app

    group = typer.main.get_command(app)
    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
            for name, cmd in group.commands.items()}


def known_flags(root: Path) -> set[str]:
    """Flags anything runnable here takes: quoted in ``meshserve/`` or named in the Makefile."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in (root / "meshserve").rglob("*.py"))
    makefile = (root / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"[\"'](--[a-z0-9][a-z0-9-]*)", text)) | set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", makefile))


def bad_commands(text: str, root: Path, options: dict[str, set[str]]) -> list[str]:
    """The commands of a Markdown text that name something that does not exist, each with why."""
    bad = []
    targets = makefile_targets(root / "Makefile")
    for target, _ in invocations(text, "make"):
        if re.match(r"^[a-z][a-z0-9-]*$", target) and target not in targets:
            bad.append(f"make {target}: no such target")
    for first, words in invocations(text, "python"):
        if first != "-m" or not words or words[0].split(".")[0] not in PROJECT_PACKAGES:
            continue
        if any(part.isupper() for part in words[0].split(".")):
            continue  # a placeholder, as in python -m meshserve.bench.NAME
        module, rest = words[0], words[1:]
        source = module_file(module, root)
        if source is None:
            bad.append(f"python -m {module}: no such module")
            continue
        code = source.read_text(encoding="utf-8")
        bad += [f"python -m {module} {f}: no such option" for f in flags_of(rest) if f'"{f}"' not in code]
    every = set().union(*options.values())
    for sub, rest in invocations(text, "meshserve"):
        for name in sub.split("|"):
            if not re.match(r"^[a-z][a-z-]*$", name):
                continue
            if name not in options:
                bad.append(f"meshserve {name}: no such command")
                continue
            bad += [f"meshserve {name} {f}: no such option" for f in flags_of(rest) if f not in options[name]]
    flags = every | known_flags(root)
    for span in code_spans(text):
        first = span.split()[0]
        if first in ("meshserve", "python") or first.endswith("/python"):
            continue
        bad += [f"{f}: no command takes it" for f in flags_of(span.split()) if f not in flags]
    return bad


# -- the tests ------------------------------------------------------------------


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES, f"README.md has {len(lines)} lines (limit {README_MAX_LINES})"


def test_manual_pages_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"structures.md", "api.md", "engine.md", "scheduler.md", "kvstore.md", "operations.md",
            "benchmarks.md", "testing.md"} <= names


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert page.exists()
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    """The checker itself: a missing file and a missing heading are both reported."""
    (tmp_path / "other.md").write_text("# Title\n\n## Real section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#real-section) [gone](missing.md) [bad](other.md#nope)\n"
                    "[self](#page) `[code](nothere.md)` [web](https://example.com/x)\n\n"
                    "```\n[fenced](nothere.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]


def test_readme_links_reach_every_manual_page():
    readme_targets = {t.partition("#")[0] for t in links((ROOT / "README.md").read_text(encoding="utf-8"))}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= readme_targets, f"pages the README does not link: {sorted(pages - readme_targets)}"


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repo_path_in_the_manual_exists(page):
    assert missing_paths(page.read_text(encoding="utf-8"), ROOT) == []


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_in_the_manual_exists(page):
    assert bad_commands(page.read_text(encoding="utf-8"), ROOT, cli_options()) == []


def test_generated_paths_name_real_make_targets():
    assert set(GENERATED.values()) <= makefile_targets(ROOT / "Makefile")


def test_a_missing_path_is_found(tmp_path):
    """The path checker itself: missing files, folders, bare names and glob or brace
    alternatives are reported; existing ones, flag values, URLs and placeholders are not."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "mod.py").write_text("", encoding="utf-8")
    (tmp_path / "pkg" / "a.proto").write_text("", encoding="utf-8")
    text = ("# Page\n\n`pkg/sub/mod.py` `pkg/sub/gone.py` `pkg/sub/` `pkg/nothere/` `mod.py` `lost.py`\n"
            "`pkg/*.proto` `pkg/*.yml` `pkg/{sub,old}/mod.py` `~/.cache/x/` `https://example.com/a.md`\n"
            "`meshserve up --tenants tenants.toml` `python -m pytest pkg/sub/missing_test.py` `tests/gone`\n\n"
            "```bash\nrun pkg/sub/mod.py  # comment.py\ncat deploy/compose.yml\n```\n")
    assert missing_paths(text, tmp_path) == ["pkg/sub/gone.py", "pkg/nothere/", "lost.py", "pkg/*.yml",
                                             "pkg/old/mod.py", "pkg/sub/missing_test.py", "tests/gone",
                                             "deploy/compose.yml"]


def test_a_missing_command_is_found(tmp_path):
    """The command checker itself: an unknown make target, module, module option,
    CLI command or CLI option is reported; real ones are not."""
    (tmp_path / "Makefile").write_text(".PHONY: demo test\ndemo:\n\techo\ntest: demo\n\techo --quiet\n",
                                       encoding="utf-8")
    (tmp_path / "meshserve" / "bench").mkdir(parents=True)
    (tmp_path / "meshserve" / "bench" / "tool.py").write_text('p.add_argument("--rounds")\n', encoding="utf-8")
    options = {"up": {"--executors", "--metrics", "--no-metrics"}, "sim": {"--seed"}}
    text = ("`make demo` `make bench-nothing` `python -m meshserve.bench.tool --rounds 2 --nope`\n"
            "`python -m meshserve.bench.gone` `python -m pytest -q` `python -m meshserve.bench.NAME`\n"
            "`meshserve up --executors 2 --no-metrics`\n"
            "`meshserve up --gpus 2` `meshserve serve` `meshserve up|sim` `--seed` `--quiet` `--made-up`\n\n"
            "```bash\nmeshserve sim --seed 1 \\\n    --rate 3   # --also-in-comment\n```\n")
    assert bad_commands(text, tmp_path, options) == [
        "make bench-nothing: no such target",
        "python -m meshserve.bench.tool --nope: no such option",
        "python -m meshserve.bench.gone: no such module",
        "meshserve up --gpus: no such option",
        "meshserve serve: no such command",
        "meshserve sim --rate: no such option",
        "--made-up: no command takes it",
    ]

"""The documentation stays navigable: every relative link in README.md, docs/ and bench/results/
points at a file or directory of the repository, and every #anchor at a heading of its target
page (GitHub's slugs: lowercase, punctuation removed, spaces to '-', '-1', '-2' for repeats).
Also: the README keeps the two commands CI runs as written (`.ci/run`), and user and maintainer
pages carry no commit hashes or dated process words (those belong in bench/results/).

Standard library only (besides pytest as the runner): no build, no FUSE, no network."""

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]


def doc_files():
    files = [ROOT / "README.md"]
    for folder in ("docs", "bench/results"):
        files += sorted((ROOT / folder).rglob("*.md"))
    return files


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or [text](target "title"); images too. Nested brackets in the text are rare
# enough in these pages to ignore.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose_lines(text):
    """The lines outside fenced code blocks, with their numbers."""
    in_fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if in_fence is None:
                in_fence = m.group(1)
            elif m.group(1) == in_fence:
                in_fence = None
            continue
        if in_fence is None:
            yield number, line


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation (underscores are word characters)
    return text.replace(" ", "-")


def anchors(path, _cache={}):
    """Every anchor a Markdown page offers."""
    if path not in _cache:
        found, seen = set(), {}
        text = path.read_text(encoding="utf-8")
        for _, line in prose_lines(text):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
            found.update(HTML_ANCHOR.findall(line))
        _cache[path] = found
    return _cache[path]


def links(path):
    """(line number, target) of every link in a page's prose."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        m = REF_DEF.match(line)
        if m:
            yield number, m.group(1)
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            yield number, target


def broken(path):
    """What is wrong with each relative link of a page."""
    problems = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        where = f"{path.relative_to(ROOT)}:{number}: ({target})"
        if not file_part and not anchor:
            problems.append(f"{where} empty link")
            continue
        try:
            dest.relative_to(ROOT)
        except ValueError:
            problems.append(f"{where} points outside the repository")
            continue
        if not dest.exists():
            problems.append(f"{where} no such file or directory")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                problems.append(f"{where} an anchor into a non-Markdown target")
            elif unquote(anchor) not in anchors(dest):
                problems.append(f"{where} no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert broken(page) == []


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in doc_files()}
    for page in [
        "README.md",
        "docs/install.md",
        "docs/mount.md",
        "docs/troubleshooting.md",
        "docs/benchmarks.md",
        "docs/architecture.md",
        "docs/development.md",
    ]:
        assert page in names


def test_slugs_follow_github():
    assert slug("Large files") == "large-files"
    assert slug("What `--allow-other` means") == "what---allow-other-means"
    assert slug("The wheel (a cluster user, no root)") == "the-wheel-a-cluster-user-no-root"
    assert slug("`convert --to parquet`") == "convert---to-parquet"
    assert slug("Why no tokio, and where memmap2") == "why-no-tokio-and-where-memmap2"
    assert slug("[Linked](x.md) heading") == "linked-heading"


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
    page = ROOT / "docs" / "mount.md"
    text = "# T\n\n[ok](#t) [bad](#nope) [gone](missing.md) `[code](missing.md)`\n```\n[x](y.md)\n```\n"
    fake = tmp_path / "page.md"
    fake.write_text(text, encoding="utf-8")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    problems = broken(fake)
    assert len(problems) == 2, problems
    assert "#nope" in problems[0] and "missing.md" in problems[1]
    assert page.exists()


def test_the_readme_keeps_the_two_commands_ci_runs():
    """.ci/run runs scripts/demo and scripts/test "as the README writes them"."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```sh\n(.*?)^```", readme, re.S | re.M)
    commands = {line.split("#")[0].strip() for block in blocks for line in block.splitlines()}
    for command in ("scripts/demo", "scripts/test"):
        assert command in commands, f"the README no longer shows `{command}`"
        assert re.search(rf"^{command}$", ci, re.M), f".ci/run no longer runs `{command}`"


PROCESS_WORDS = re.compile(
    r"\b(?:this|last|earlier|next|that) turn\b|\bturn \d\b|^#+ .*\bissue \d+|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b",
    re.I | re.M,
)


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_pages_carry_no_commit_hashes_or_process_words(page):
    """Dated measurements, commits and turns belong in bench/results/, not in the manual."""
    hits = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)}"
        for n, line in prose_lines(page.read_text(encoding="utf-8"))
        for m in [PROCESS_WORDS.search(line)]
        if m
    ]
    assert hits == []


def test_every_docs_page_is_in_the_index():
    """docs/README.md lists every page, so none is only reachable by guessing its name."""
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p not in listed]
    assert missing == []

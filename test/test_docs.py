"""The docs stay navigable: docs/RESULTS.md holds the current figures in at most 400 lines
(the history of runs is docs/results/log.md), and every relative link in README.md and the
Markdown under docs/ points to a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_RESULTS_LINES = 400
# [text](target) and ![alt](target), an optional "title" after the target.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Link targets outside code, without their ``#anchor``; web, mail and in-page links
    left out."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(root)} links {target}"
        for path in files
        for target in relative_links(path.read_text())
        if not (path.parent / target).exists()
    ]


def test_results_hold_the_current_figures_in_at_most_400_lines():
    lines = len((ROOT / "docs" / "RESULTS.md").read_text().splitlines())
    assert lines <= MAX_RESULTS_LINES, f"docs/RESULTS.md has {lines} lines"
    assert "(results/log.md)" in (ROOT / "docs" / "RESULTS.md").read_text()


def test_every_relative_link_points_to_a_file():
    files = markdown_files()
    assert len(files) > 10 and ROOT / "docs" / "results" / "log.md" in files
    bad = broken_links(files)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_link_check_reads_links_outside_code_only(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        '[ok](here.md#part) [gone](missing.md) ![img](pic.png "a title")\n'
        "[web](https://example.com/x.md) [anchor](#top) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
    )
    assert broken_links([page], tmp_path) == [
        "docs/page.md links missing.md",
        "docs/page.md links pic.png",
    ]


# A line opening a package's list in docs/structures.md: "## Lab: `sgl_ecospec/lab/`" or
# "`sgl_ecospec/ops/`: the ops".
PACKAGE_LINE = re.compile(r"^(?:#+ [^`\n]*)?`((?:sgl_ecospec|python)/(?:\w+/)*)`", re.MULTILINE)


def package_blocks(text: str) -> dict[str, str]:
    """Each package's part of docs/structures.md, from its opening line to the next one."""
    starts = list(PACKAGE_LINE.finditer(text))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return {m.group(1): text[m.start() : end] for m, end in zip(starts, ends, strict=True)}


def unlisted_modules(text: str, root: Path = ROOT) -> list[str]:
    """Modules under sgl_ecospec/ and python/ that their package's part does not name as a
    list item (``- `name.py```)."""
    blocks = package_blocks(text)
    missing = []
    for top in ("sgl_ecospec", "python"):
        for path in sorted((root / top).rglob("*.py")):
            package = path.parent.relative_to(root).as_posix() + "/"
            if not re.search(
                rf"^- (?:`[\w.]+`, )*`{re.escape(path.name)}`", blocks.get(package, ""), re.M
            ):
                missing.append(path.relative_to(root).as_posix())
    return missing


def test_structures_names_every_module():
    missing = unlisted_modules((ROOT / "docs" / "structures.md").read_text())
    assert not missing, "modules docs/structures.md does not list:\n" + "\n".join(missing)

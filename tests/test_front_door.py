"""The front door stays one: the README short, the Quickstart near its top, its sentences
readable, its measured figures in tables generated from their JSON, and every link and
`#anchor` of README.md, docs/ and examples/ pointing at something that exists.

Fast: files are read, nothing is trained; the figures come from `benchmarks/figures.py`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 150
QUICKSTART_BY = 40
MAX_WORDS = 40

sys.path.insert(0, str(ROOT))


# ---- reading markdown -----------------------------------------------------------------------

FENCE = re.compile(r"^ *(```|~~~).*?^ *\1[^\n]*$", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]*(?:\([^()]*\)[^()\s]*)*)\)")
CODE = re.compile(r"`[^`\n]+`")


def prose(text: str) -> str:
    """The text a reader reads as sentences: no code blocks, comments or table rows; a link
    is its text; an inline code span is one word."""
    text = COMMENT.sub("", FENCE.sub("", text))
    text = CODE.sub("CODE", text)
    text = LINK.sub(lambda m: m.group(1), text)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("|")]
    return "\n".join(lines)


def sentences(text: str) -> list[str]:
    """Sentences of prose: a paragraph, a list item or a heading is a unit; a unit splits
    after `.`, `!` or `?` followed by a space and a capital, a digit, a bracket or code."""
    units = []
    for block in re.split(r"\n\s*\n", prose(text)):
        for unit in re.split(r"\n(?=\s*(?:[-*+]|\d+\.|#+) )", block):
            unit = " ".join(unit.split())
            if unit:
                units.append(unit)
    out = []
    for unit in units:
        out += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9(\[\"'*C])", unit) if s.strip()]
    return out


def words(sentence: str) -> int:
    return len(re.findall(r"[^\s\-–—|#*]+", sentence))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation other
    than `-` and `_` dropped, spaces as `-`."""
    text = LINK.sub(lambda m: m.group(1), heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every `#anchor` a page has: its headings' slugs (a repeated one gets -1, -2, ...) and
    explicit `id`/`name` attributes."""
    text = FENCE.sub("", page.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r"""<a [^>]*(?:name|id)=["']([^"']+)["']""", text))
    return found


def pages() -> list[Path]:
    return [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "examples").rglob("*.md"))]


def examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.yaml"))


def header(example: Path) -> list[str]:
    """The comment lines an example opens with."""
    out = []
    for line in example.read_text().splitlines():
        if not line.startswith("#"):
            break
        out.append(line)
    return out


def broken(source: Path, target: str, base: Path) -> str | None:
    """Why `target`, linked from `source` relative to `base`, points at nothing (None: it
    is fine or not ours to check)."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
        return None  # https:, mailto:, ...
    path, _, anchor = target.partition("#")
    where = (base / path).resolve() if path else source
    if not where.exists():
        return f"{source.relative_to(ROOT)}: `{target}`: no {path}"
    if anchor and where.is_file() and where.suffix == ".md" and anchor not in anchors(where):
        return f"{source.relative_to(ROOT)}: `{target}`: {path or 'this page'} has no #{anchor}"
    return None


# ---- the README ------------------------------------------------------------------------------


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"


def test_quickstart_is_on_the_first_screen():
    lines = README.read_text().splitlines()
    where = [i + 1 for i, line in enumerate(lines) if line.strip() == "## Quickstart"]
    assert where, "README.md has no `## Quickstart` heading"
    assert where[0] <= QUICKSTART_BY, f"`## Quickstart` is on line {where[0]}"


def test_quickstart_says_what_a_newcomer_needs():
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    section = section[:section.index("\n## ", 1)]
    import tomllib

    python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f"Python {python.removeprefix('>=')}" in section, python
    assert "git clone" in section and "No GPU" in section and "2 CPU cores" in section
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest' in section
    assert 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest' in (
        ROOT / ".ci" / "run").read_text()


def test_readme_sentences_are_short():
    long = [(words(s), s) for s in sentences(README.read_text()) if words(s) > MAX_WORDS]
    assert not long, "\n\n".join(f"{n} words: {s}" for n, s in long)


# Measured quantities: a percentage, a ratio, a time, a size.
FIGURE = re.compile(r"\b\d[\d,.]*\s*(?:%|x\b|s\b|min\b|ms\b|MiB\b|GiB\b|KB\b|MB\b|GB\b|"
                    r"tok/s\b|tokens/s\b)")


def test_readme_figures_are_in_tables():
    found = [s for s in sentences(README.read_text()) if FIGURE.search(s)]
    assert not found, "figures in README prose (put them in a generated table):\n" + \
        "\n".join(found)


def test_readme_links_every_page_of_the_docs():
    text = README.read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"docs/{p.name}" not in text]
    assert not missing, missing


def test_readme_status_is_the_gpu_files():
    from benchmarks.figures import gpu_speed

    cards, low, high = gpu_speed()
    assert f"{low:.2f}-{high:.2f}x" in README.read_text()
    assert "implemented, never run" in README.read_text()
    assert cards


# ---- sentence splitting and slugs are what they claim ------------------------------------


def test_sentence_splitting_reads_prose_only():
    text = ("# Title\n\nOne short sentence. Another one, with `a.b` code and a "
            "[link](docs/x.md#y).\n\n| a | b. C |\n|---|---|\n\n```bash\nx. Y z\n```\n"
            "- an item. Its second sentence\n- another item\n")
    assert sentences(text) == ["# Title", "One short sentence.",
                               "Another one, with CODE code and a link.", "- an item.",
                               "Its second sentence", "- another item"]
    assert words("Another one, with CODE code and a link.") == 8


@pytest.mark.parametrize(("heading", "anchor"), [
    ("Measured on an H100 and an H200", "measured-on-an-h100-and-an-h200"),
    ("Against DeepSpeed ALST on CPU, measured", "against-deepspeed-alst-on-cpu-measured"),
    ("Hybrid models: layers that mix tokens outside attention (`token_mixing.py`)",
     "hybrid-models-layers-that-mix-tokens-outside-attention-token_mixingpy"),
    ("The bundled example (the Quickstart)", "the-bundled-example-the-quickstart"),
])
def test_github_slugs(heading, anchor):
    assert slug(heading) == anchor


# ---- links and anchors -----------------------------------------------------------------------


def test_every_relative_link_and_anchor_resolves():
    problems = []
    for page in pages():
        text = COMMENT.sub("", FENCE.sub("", page.read_text()))
        for match in LINK.finditer(text):
            target = match.group(2).strip("<>")
            if target:
                problem = broken(page, target, page.parent)
                if problem:
                    problems.append(problem)
    assert not problems, "\n".join(problems)


# A page named in an example's header: `docs/x.md`, `README.md#status`, `../docs/y.md#z`.
NAMED = re.compile(r"(?<![\w/.])((?:\.\./)?(?:[\w.-]+/)*[\w.-]+\.md)(#[\w-]+)?")


@pytest.mark.parametrize("example", examples(), ids=lambda p: p.name)
def test_example_headers_point_at_sections_that_exist(example: Path):
    problems = []
    for line in header(example):
        for path, anchor in NAMED.findall(line):
            problem = broken(example, path + anchor, ROOT)
            if problem:
                problems.append(problem)
        # `(README, "Some section")`: a section named in words must be a heading there.
        for page, name in re.findall(r"\b(README|docs/[\w.-]+\.md)\W{0,3}\"([^\"]+)\"", line):
            target = README if page == "README" else ROOT / page
            if slug(name) not in anchors(target):
                problems.append(f"{example.name}: {page} has no section {name!r}")
    assert not problems, "\n".join(problems)


# ---- examples ----------------------------------------------------------------------------------


def runs_on_gpus(example: Path) -> bool:
    """A GPU example: one the tiny CPU examples are not (its name does not start `tiny_`)."""
    return not example.name.startswith("tiny_")


@pytest.mark.parametrize("example", [e for e in examples() if runs_on_gpus(e)],
                         ids=lambda p: p.name)
def test_gpu_examples_repeat_the_status(example: Path):
    from benchmarks.figures import status_line

    assert f"# {status_line()}" in header(example), (
        f"{example.name}'s header should repeat the README's status line:\n# {status_line()}")


def test_every_example_that_needs_a_run_first_says_so_in_its_first_line_and_the_readme():
    readme = README.read_text()
    for example in examples():
        base = str(yaml.safe_load(example.read_text()).get("base_model") or "")
        if base.startswith("outputs/"):
            first = header(example)[0] if header(example) else ""
            assert re.search(r"\b(after|first run|run .* before)\b", first, re.I), (
                f"{example.name} starts from {base}: its first line should say what runs "
                f"before it, not {first!r}")
            assert f"`{example.name}`" in readme and "first line" in readme, example.name


def test_the_data_readme_lists_every_data_file():
    folder = ROOT / "examples" / "data"
    listed = (folder / "README.md").read_text()
    missing = [p.name for p in sorted(folder.iterdir())
               if p.is_file() and p.name != "README.md" and f"`{p.name}`" not in listed]
    assert not missing, f"examples/data/README.md does not list {missing}"


# ---- figures -------------------------------------------------------------------------------------


# Figures on these pages that are not measurements: settings, defaults, constants of the code,
# bounds and arithmetic. Any other figure outside a generated block is a measurement with no
# home: put it in a block `benchmarks/figures.py` writes from its JSON, or link to that block.
NOT_MEASURED = {
    "benchmarks/README.md": {"384 MiB", "160 MiB"},  # the memory caps the runs were given
    "docs/cli.md": {"64 MiB", "1 GiB", "10%"},  # the fused loss's block, the fit's margin
    "docs/config.md": {"64 MiB"},  # the head chunks' target (ulysses_head_chunks)
    "docs/context.md": {"10%", "50%", "90%"},  # the needle's depths
    "docs/eval.md": {"0%", "50%", "100%"},  # the heatmap's colour scale, a depth
    "docs/families.md": {"3x"},  # the fidelity probe's allowance
    "docs/gpu.md": {"80GB", "80 GB"},  # the card's memory
    "docs/memory.md": {"64 MiB", "1 MiB", "32 MiB", "1 GiB", "10%",  # constants of the code
                       # and of glibc, the fit's margin; the estimate test's bounds; the
                       # issue's reach targets against ALST
                       "0.9-1.15x", "0.85-1.2x", "0.67x", "0.5x"},
    "docs/parallelism.md": {"0.75x", "3x", "8/2", "8/4"},  # a bound, an allowance, GQA ratios
    "docs/reliability.md": {"600 s", "60 s", "0.5 s", "10 s", "300 s", "2 s", "30 MB"},
    "docs/results.md": {"64 MiB", "1 MiB"},  # the fused loss's block, the mmap threshold
    "docs/strategies.md": {"1.41 GB", "0.2 GB", "0.59 GB", "0.71 GB", "2.4x"},  # formulas
    "docs/training.md": {"300 s", "3%"},  # a default, the share of 4-bit scales
}
GENERATED = re.compile(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", re.S)
# A measured quantity in prose: a percentage, a ratio (`0.72x`, not `2 x sp`), a time, a size,
# or a bare count of successes (`35/40`; not `ZeRO-1/2`, `4/8-bit` or `sp 1/2/4`).
MEASURED = re.compile(r"\b\d[\d,.]*(?:-\d[\d,.]*)?"
                      r"(?:%|x\b| ?(?:s|min|ms|MiB|GiB|KB|MB|GB|tok/s|tokens/s)\b)"
                      r"|(?<![/\d.\w-])\d+/\d+(?![/\d-])")


def loose_figures(page: Path) -> list[str]:
    """The figures of `page` outside generated blocks, code and comments."""
    text = CODE.sub("CODE", COMMENT.sub("", FENCE.sub("", GENERATED.sub("", page.read_text()))))
    return [m.group(0) for m in MEASURED.finditer(text)]


def test_loose_figures_are_caught():
    assert MEASURED.findall("ran at 0.72-0.82x, 5.2 min, 601 MiB, 73.3%; tp 2 x sp 2") == [
        "0.72-0.82x", "5.2 min", "601 MiB", "73.3%"]
    assert MEASURED.findall("found 35/40 keys at sp 1/2/4 with ZeRO-1/2 and 4/8-bit") == [
        "35/40"]


@pytest.mark.parametrize("page", [p for p in pages() if p.parent.name != "examples"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_measured_figure_is_generated_from_its_json(page: Path):
    allowed = NOT_MEASURED.get(str(page.relative_to(ROOT)), set())
    loose = [f for f in loose_figures(page) if f not in allowed]
    assert not loose, (f"{page.relative_to(ROOT)}: figures outside a generated block: {loose}. "
                       "Generate them from their results JSON (benchmarks/figures.py) or link "
                       "to the block that does.")


def test_every_generated_block_is_its_json():
    from benchmarks.figures import stale

    problems = stale()
    assert not problems, ("\n\n".join(problems)
                          + "\n\nRegenerate with `python benchmarks/figures.py`.")

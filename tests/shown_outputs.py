"""The command outputs that README.md and docs/*.md show, produced by the commands themselves.

    python -m tests.shown_outputs           # rewrite every shown output from a fresh run
    python -m tests.shown_outputs --check   # change nothing; exit 1 with a diff where one is stale

tests/test_shown_outputs.py runs the check. Two kinds of block:

* An output block: a marker line `<!-- output: COMMAND -->`, a fenced block, then
  `<!-- /output -->`. The fenced block is `$ COMMAND` followed by what COMMAND prints (stdout
  and stderr together), then `$ echo $?` and the status where it is not 0. COMMAND runs with
  bash in a fresh folder that holds a link to the repository's `examples/` and the files of
  `FIXTURES` (configs a page describes in words, such as a plan that cannot work), as on a
  laptop without network (`HF_HUB_OFFLINE=1`) and an 80-column terminal (`COLUMNS=80`; a
  command may set its own). Only cheap commands belong here: `--help`, `validate`.
* A log block: `<!-- log: longctx train CONFIG --nproc-per-node N -->`, a fenced excerpt of
  what that run prints, `<!-- /log -->`. A training run is too slow to repeat in a test, so
  its lines are held to what the code would print instead: each line is `...` (lines left
  out) or has the shape of a line the code prints (a template read from the f-strings of
  `LOG_SOURCES`: literal text equal, each `{value}` any text); a step line's total is the
  config's `max_steps`; the start-up line names only phases the code marks; the `layout:`
  line is exactly what the plan of that config and world prints now, and the fidelity
  probe's verdict has the shape of one `checks/fidelity.py` writes.
* A message block: `<!-- message: NAME -->`, a fenced message (an error or warning a run
  prints when something goes wrong), `<!-- /message -->`. The test that provokes it calls
  `assert_shown_message(NAME, printed)`, which fails unless the message appears in what was
  printed: each number in the shown text stands for any number, each path for any path, `...`
  for any text, and the rest must be equal (where lines wrap aside). `--check` fails on a
  message block that no test names.

The comparison of an output block ignores what changes from run to run or machine to
machine: seconds in parentheses (`(2.6s)`), the fidelity probe's float-noise figures
(`rel. err 0.0e+00`, `worst 2.3e-06`) and where the terminal wraps (runs of white space).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Configs the pages describe in words, written into the folder the commands run in.
FIXTURES = {
    # docs/cli.md: an impossible plan, `sequence_parallel_degree: 3` on 4 ranks.
    "my.yaml": ("examples/tiny_passkey.yaml", {"sequence_parallel_degree": 3}),
    # docs/context.md: a model with 8,192 native positions trained at 16,384 under yarn.
    "long.yaml": ("examples/tiny_passkey.yaml", {
        "sequence_len": 16384, "rope_scaling": {"type": "yarn", "factor": "auto"},
        "rope_theta": 100000.0}),
}

# Where the lines of a training run's log are formatted.
LOG_SOURCES = [
    "longctx_cli/data/prepare.py",
    "longctx_cli/train/loop.py",
    "longctx_cli/checks/fidelity.py",
    "longctx_cli/train/metrics.py",
    "longctx_cli/launcher/startup.py",
    "longctx_cli/train/summary.py",
    "longctx_cli/train/run.py",
]

BLOCK = re.compile(
    r"(?P<open>[ ]*<!-- (?P<kind>output|log|message): (?P<command>.+?) -->\n)"
    r"(?P<body>(?P<indent>[ ]*)```\n.*?(?P=indent)```\n)"
    r"(?P=indent)(?P<close><!-- /(?P=kind) -->)", re.S)

VOLATILE = [
    (re.compile(r"\(\d+(?:\.\d+)?s\)"), "(<seconds>)"),
    (re.compile(r"(rel\. err|worst) \d\.\de[-+]\d+"), r"\1 <float noise>"),
]


@dataclass
class Block:
    page: Path
    kind: str
    command: str
    body: str  # the fenced block's text, fences excluded
    start: int
    end: int


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, m["kind"], m["command"],
                  textwrap.dedent("".join(m["body"].splitlines(keepends=True)[1:-1])),
                  m.start("body"), m.end("body")) for m in BLOCK.finditer(text)]


# ---- output blocks ------------------------------------------------------------------------


def _write_fixtures(folder: Path) -> None:
    import yaml

    (folder / "examples").symlink_to(ROOT / "examples")
    for name, (base, changes) in FIXTURES.items():
        config = yaml.safe_load((ROOT / base).read_text())
        config.update(changes)
        (folder / name).write_text(yaml.safe_dump(config, sort_keys=False))


def run_output(command: str) -> str:
    """`$ command`, what it prints, and its exit status unless 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TERM")}
    env.update(COLUMNS="80", HF_HUB_OFFLINE="1", NO_COLOR="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    with tempfile.TemporaryDirectory(prefix="longctx-shown-") as tmp:
        _write_fixtures(Path(tmp))
        result = subprocess.run(["bash", "-c", command], cwd=tmp, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    printed = "\n".join(line.rstrip() for line in result.stdout.splitlines()).strip("\n")
    lines = [f"$ {command}", *printed.splitlines()]
    if result.returncode != 0:
        lines += ["$ echo $?", str(result.returncode)]
    return "\n".join(lines) + "\n"


def normalise(text: str) -> str:
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    return " ".join(text.split())


# ---- log blocks ---------------------------------------------------------------------------


def _templates(source: Path) -> list[re.Pattern[str]]:
    """One pattern per line of every f-string in `source` that starts with a word: its
    literal text, each `{value}` any text; an f-string that is the left side of `+` may go on
    (what is added)."""
    tree = ast.parse(source.read_text())
    continued = {id(node.left) for node in ast.walk(tree)
                 if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr):
            continue
        lines = [""]
        for part in node.values:
            if isinstance(part, ast.Constant):
                first, *rest = str(part.value).split("\n")
                lines[-1] += re.escape(first)
                lines += [re.escape(text) for text in rest]
            else:
                lines[-1] += ".*?"
        tail = ".*" if id(node) in continued else ""
        # A line of the log starts with words of its own (`step `, `done: `): a template
        # that starts with a value (`{name} {seconds}`) would match any line.
        out += [re.compile(line + tail) for line in lines if re.match(r"[A-Za-z]{4}", line)]
    return out


def _marked_phases() -> set[str]:
    """The start-up phases the code marks (`clock.mark(...)`), and torchrun's gap."""
    names = {"torchrun"}
    for path in (ROOT / "longctx_cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "mark"):
                names |= {c.value for arg in node.args for c in ast.walk(arg)
                          if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return names


def _run_settings(command: str) -> tuple[Path, int]:
    words = shlex.split(command)
    if words[:2] != ["longctx", "train"] or "--nproc-per-node" not in words:
        raise ValueError(f"a log block names `longctx train CONFIG --nproc-per-node N`: {command}")
    return ROOT / words[2], int(words[words.index("--nproc-per-node") + 1])


def check_log(command: str, body: str) -> list[str]:
    """What in the excerpt `body` of `command`'s log the code would not print."""
    from longctx_cli.config import load_config
    from longctx_cli.config.plan import plan_for

    config_path, nproc = _run_settings(command)
    config = load_config(config_path)
    plan = plan_for(config, nproc, 1)
    layout = f"layout: {plan.layout.describe()} ({plan.layout.kernel_reason})"
    templates = [t for source in LOG_SOURCES for t in _templates(ROOT / source)]
    verdicts = _templates(ROOT / "longctx_cli/checks/fidelity.py")
    phases = _marked_phases()
    problems = []
    for line in body.splitlines():
        if line.strip() in ("", "..."):
            continue
        if not any(t.fullmatch(line) for t in templates):
            problems.append(f"no line of {', '.join(LOG_SOURCES)} has this shape: {line}")
        verdict = line.removeprefix("fidelity probe: ")
        if verdict != line and not any(t.fullmatch(verdict) for t in verdicts):
            problems.append(f"the fidelity probe's verdict has another shape now: {line}")
        if line.startswith("layout: ") and line != layout:
            problems.append(f"the plan prints `{layout}`, not: {line}")
        step = re.match(r"step \d+/(\d+) ", line)
        if step and int(step[1]) != config.training.max_steps:
            problems.append(f"max_steps is {config.training.max_steps}: {line}")
        startup = re.fullmatch(r"first step [\d.]+ s after the command \((.*)\)", line)
        if startup:
            named = re.findall(r"(.+?) \d+\.\d(?:, |$)", startup[1])
            unknown = [name for name in named if name not in phases]
            if unknown:
                problems.append(f"no start-up phase is marked {unknown}: {line}")
    return problems


# ---- message blocks -------------------------------------------------------------------------

# In a shown message: `...` (text left out), a path (has a `/`), a number; else one character.
_MESSAGE_PARTS = re.compile(r"(?P<path>[\w.~-]*/[\w./~-]*)|(?P<gap>\.\.\.)"
                            r"|(?P<number>\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)|(?P<char>.)", re.S)


def message_pattern(shown: str) -> re.Pattern[str]:
    """The printed text a shown message stands for (white space normalised on both sides)."""
    out = []
    for m in _MESSAGE_PARTS.finditer(" ".join(shown.split())):
        if m["path"]:
            out.append(r"[^\s'\"]+")
        elif m["gap"]:
            out.append(r".*?")
        elif m["number"]:
            out.append(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
        else:
            out.append(r"\s*" if m["char"] == " " else re.escape(m["char"]))
    return re.compile("".join(out))


def shown_message(name: str, pages: list[Path] = PAGES) -> str:
    found = [b.body for page in pages for b in blocks(page)
             if b.kind == "message" and b.command == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} message blocks are named {name!r} in README/docs")
    return found[0]


def assert_shown_message(name: str, printed: str) -> None:
    """Fail unless the message block `name` of README/docs is what `printed` says now."""
    shown = shown_message(name)
    if not message_pattern(shown).search(" ".join(printed.split())):
        raise AssertionError(
            f"the message shown as {name!r} in the docs is not what the code prints now.\n"
            f"shown:\n{shown}\nprinted (its end):\n{printed[-3000:]}")


def _messages_tests_name() -> set[str]:
    named = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        named |= set(re.findall(r"assert_shown_message\(\s*\"([^\"]+)\"", path.read_text()))
    return named


# ---- pages --------------------------------------------------------------------------------


def check(pages: list[Path] = PAGES, outputs: bool = True) -> list[str]:
    """Every stale shown output, as a message (with a diff for an output block); `outputs`
    False: the log blocks only."""
    problems = []
    named = _messages_tests_name()
    for page in pages:
        for block in blocks(page):
            where = f"{page.relative_to(ROOT)}: `{block.command}`"
            if block.kind == "message":
                if block.command not in named:
                    problems.append(f"{where}: no test calls assert_shown_message(\""
                                    f"{block.command}\", ...) with what it printed")
                continue
            if block.kind == "log":
                problems += [f"{where}: {p}" for p in check_log(block.command, block.body)]
                continue
            if not outputs:
                continue
            fresh = run_output(block.command)
            if normalise(fresh) != normalise(block.body):
                diff = "\n".join(difflib.unified_diff(
                    block.body.splitlines(), fresh.splitlines(), "shown", "printed now",
                    lineterm=""))
                problems.append(f"{where} prints something else now:\n{diff}")
    return problems


def rewrite(pages: list[Path] = PAGES) -> list[Path]:
    """Rewrite every output block from a fresh run; the pages changed."""
    changed = []
    for page in pages:
        text = page.read_text()
        for block in reversed(blocks(page)):
            if block.kind == "output":
                fresh = run_output(block.command)
                if normalise(fresh) != normalise(block.body):
                    text = text[:block.start] + "```\n" + fresh + "```\n" + text[block.end:]
        if text != page.read_text():
            page.write_text(text)
            changed.append(page)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 where a shown output is stale")
    args = parser.parse_args()
    if args.check:
        problems = check()
        print("\n\n".join(problems) or "every shown output is current")
        sys.exit(1 if problems else 0)
    for page in rewrite():
        print(f"rewrote {page.relative_to(ROOT)}")
    problems = check(outputs=False)
    if problems:
        print("\n\n".join(problems))
        sys.exit(1)

if __name__ == "__main__":
    main()

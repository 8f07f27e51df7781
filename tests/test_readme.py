"""README.md's and docs/*.md's Python and shell blocks, run as written, so the documentation cannot drift
from the code (issue 36: README's own journey raised a TypeError and nothing ran it).

Each fenced block carries a language. `python` blocks run as a script, `bash` blocks command by command, in
a temporary folder that links the repository's top-level entries (examples/train_gpt.py, README.md), with
`autopar`, `torchrun` and `python` this interpreter over this checkout. In a bash block, `$ ` starts a
command where the block shows output (the other lines are what it prints); without prompts, a line at the
margin starts a command and an indented one is output. A command succeeds, or fails when its output shows
`autopar: error:`; its printed lines must appear in order, whitespace-insensitive, `...` standing for
what the block leaves out. HTML comments right above a block say how CI runs it, visibly:

    <!-- ci: skip (reason) -->              not run (installs, the suite itself); few, each with a reason
    <!-- ci: fragment (reason) -->          not standalone code; as few as skips
    <!-- ci: torchrun --nproc_per_node 2 --> a Python block that runs on every rank
    <!-- ci: output varies (reason) -->     figures are machine- or text-dependent: each figure matches any
                                            figure, and a report's `<-- ...` flag notes are not required
    <!-- ci: A → B -->                      CI runs the block with A replaced by B (a smaller budget)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dist_harness import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
RUN_LANGS = {"python": "python", "bash": "shell"}
TEXT_LANGS = {"text", "toml", "json"}  # shown, not run
MAX_NOT_RUN = 3  # skip + fragment blocks over all documents
MAX_SUBSTITUTIONS = 3
COMMAND_TIMEOUT_S = 300

_FENCE = re.compile(r"^(\s*)(```+)\s*(\S*)\s*$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*ci:\s*(.*?)\s*-->\s*$")
_REASONED = re.compile(r"^(skip|fragment|output varies) \((.+)\)$")
_TORCHRUN = re.compile(r"^torchrun --nproc_per_node (\d+)$")
_SUBSTITUTION = re.compile(r"^(.+?) → (.+)$")
# pieces of an expected output line: whitespace, an ellipsis, a progress bar, a figure (signed, grouped,
# decimal, hex or a number-bearing word such as 1.04x's 1.04 or crc e7fcc33f), any other character
_PIECE = re.compile(r"(?P<ws>\s+)|(?P<ell>\.\.\.)|(?P<bar>\[[# ]+\])|(?P<fig>[+\-−]?\w*\d\w*(?:[.,]\d+)*)|(?P<ch>.)")
_FIGURE = r"[+\-−]?\w*\d\w*(?:[.,]\d+)*"


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text (dedented) and the ci: directives above it."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    directives: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((ln for ln in self.text.splitlines() if ln.strip()), "")

    def reasoned(self, kind: str) -> str | None:
        """The reason of this block's `kind (reason)` directive, or None."""
        for d in self.directives:
            m = _REASONED.match(d)
            if m and m.group(1) == kind:
                return m.group(2)
        return None

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and self.reasoned("skip") is None and self.reasoned("fragment") is None

    @property
    def substitutions(self) -> list[tuple[str, str]]:
        return [(m.group(1), m.group(2)) for d in self.directives
                if not _REASONED.match(d) and not _TORCHRUN.match(d) and (m := _SUBSTITUTION.match(d))]

    @property
    def torchrun_nproc(self) -> int | None:
        return next((int(m.group(1)) for d in self.directives if (m := _TORCHRUN.match(d))), None)

    def ci_text(self) -> str:
        """The text CI runs: the block with its substitutions applied."""
        text = self.text
        for old, new in self.substitutions:
            text = text.replace(old, new)
        return text


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == fence)
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        directives, k = [], i - 1
        while k >= 0 and (d := _DIRECTIVE.match(lines[k])):
            directives.insert(0, d.group(1))
            k -= 1
        found.append(Block(path, i + 1, lang, "\n".join(body), tuple(directives)))
        i = end + 1
    return found


ALL = [b for path in DOCS for b in blocks(path)]
RUNNABLE = [b for b in ALL if b.runs]


def test_every_block_is_run_or_says_why_not():
    not_run, substitutions = [], 0
    for b in ALL:
        assert b.lang in RUN_LANGS or b.lang in TEXT_LANGS, (
            f"{b.where} `{b.first_line}`: a block needs a language, one of {sorted(RUN_LANGS)} (run in CI) or "
            f"{sorted(TEXT_LANGS)} (shown); got {b.lang!r}")
        for d in b.directives:
            assert _REASONED.match(d) or _TORCHRUN.match(d) or _SUBSTITUTION.match(d), (
                f"{b.where}: unknown directive <!-- ci: {d} -->; see tests/test_readme.py's docstring")
        for old, _ in b.substitutions:
            assert old in b.text, f"{b.where}: substitution of {old!r}, which the block does not contain"
        substitutions += len(b.substitutions)
        if b.lang in RUN_LANGS and not b.runs:
            not_run.append(b.where)
        if b.torchrun_nproc is not None:
            assert b.lang == "python", f"{b.where}: the torchrun directive is for Python blocks"
    assert len(not_run) <= MAX_NOT_RUN, f"too many blocks skipped or marked fragments: {not_run}"
    assert substitutions <= MAX_SUBSTITUTIONS, f"{substitutions} CI substitutions; keep them few"
    assert len(RUNNABLE) >= 7, [b.where for b in RUNNABLE]  # the journey, the CLI, the chains: a parser slip shows


@dataclass(frozen=True)
class Command:
    """A shell command of a block, the line it starts on and the output lines the block shows for it."""

    text: str
    line: int
    expected: tuple[tuple[int, str], ...]

    @property
    def should_fail(self) -> bool:
        return any(text.startswith("autopar: error:") for _, text in self.expected)


def commands(block: Block) -> list[Command]:
    lines = block.ci_text().split("\n")
    prompts = any(ln.startswith("$ ") for ln in lines)
    cmds: list[list] = []  # [text, line, expected]
    continued = False
    for offset, ln in enumerate(lines, start=block.line + 1):
        if continued:
            cmds[-1][0] += "\n" + ln
        elif not ln.strip():
            continue
        elif ln.startswith("$ ") if prompts else (not ln[0].isspace() and not ln.startswith("#")):
            cmds.append([ln[2:] if prompts else ln, offset, []])
        elif ln.startswith("#") and not prompts:
            continue
        else:
            assert cmds, f"{block.where}: output line {offset} before any command"
            cmds[-1][2].append((offset, ln.strip()))
        continued = ln.endswith("\\")
    return [Command(text, line, tuple(expected)) for text, line, expected in cmds]


def line_pattern(text: str, varies: bool) -> re.Pattern:
    """An expected output line as a regex: whitespace flexible, `...` any text on the line; where output
    varies, any figure for each figure and the bar of any progress, and no `<-- ...` flag note."""
    if varies:
        text = text.split("<--")[0].rstrip()
    out = []
    for m in _PIECE.finditer(text):
        kind = m.lastgroup
        if kind == "ws":
            out.append(r"\s+")
        elif kind == "ell":
            out.append(r".*?")
        elif kind == "bar" and varies:
            out.append(r"\[[# ]+\]")
        elif kind == "fig" and varies:
            out.append(_FIGURE)
        else:
            out.append(re.escape(m.group()))
    return re.compile("".join(out))


def _workdir(tmp: Path) -> dict[str, str]:
    """Link the repository's top-level entries into `tmp`; the environment that runs this checkout."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith("."):
            (tmp / entry.name).symlink_to(entry)
    bin_dir = tmp / ".bin"
    bin_dir.mkdir()
    for name, run in {"autopar": "-m autopar.cli.main", "torchrun": "-m torch.distributed.run", "python": ""}.items():
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PET_MASTER_PORT": str(free_port())}


def _run(block: Block, what: str, argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run one command; again on a fresh port when torchrun's rendezvous found its port taken (free_port's
    port can be bound by a parallel test between the probe and torchrun's bind: EADDRINUSE before any rank
    ran, so nothing of the command happened)."""
    for _ in range(3):
        try:
            done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            pytest.fail(f"{block.where} `{block.first_line}`: {what} ran past {COMMAND_TIMEOUT_S} s\n{out[-3000:]}")
        if done.returncode == 0 or "EADDRINUSE" not in done.stdout:
            break
        env = {**env, "PET_MASTER_PORT": str(free_port())}
    return done.returncode, done.stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"{b.path.stem}_block{RUNNABLE.index(b)}")
def test_block_runs_as_written(block: Block, tmp_path: Path):
    env = _workdir(tmp_path)
    if block.lang == "python":
        script = tmp_path / f"block_{block.line}.py"
        script.write_text(block.ci_text() + "\n")
        nproc = block.torchrun_nproc
        argv = [sys.executable, script.name] if nproc is None else [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), script.name]
        rc, out = _run(block, "the block", argv, tmp_path, {**env, "OMP_NUM_THREADS": "1"})
        assert rc == 0, f"{block.where} `{block.first_line}` exited {rc}:\n{out[-3000:]}"
        return
    varies = block.reasoned("output varies") is not None
    for cmd in commands(block):
        env["PET_MASTER_PORT"] = str(free_port())
        rc, out = _run(block, f"line {cmd.line} `{cmd.text}`", ["bash", "-o", "pipefail", "-c", cmd.text],
                       tmp_path, env)
        head = f"{block.where} `{block.first_line}`, line {cmd.line} `{cmd.text}`"
        if cmd.should_fail:
            assert rc != 0, f"{head}: the block shows an error, but it exited 0:\n{out[-3000:]}"
        else:
            assert rc == 0, f"{head}: exited {rc}:\n{out[-3000:]}"
        cursor = 0
        for line, text in cmd.expected:
            m = line_pattern(text, varies).search(out, cursor)
            assert m, (f"{head}: line {line} of {block.path.name} shows `{text}`, which the command did not print "
                       f"(in order{', any figures' if varies else ''}); it printed:\n{out[cursor:][-3000:]}")
            cursor = m.end()


def test_output_lines_match_as_the_docstring_says():
    """The matcher the block tests rely on: `...` skips text, whitespace is flexible, figures are exact unless
    the output varies, and a block's commands and shown output are told apart as documented."""
    exact = line_pattern("predicted       step 31.940 s, ...  |  4,104 tokens/s", varies=False)
    assert exact.search("predicted step 31.940 s, runs of this kind (x) | 4,104 tokens/s | more")
    assert not exact.search("predicted step 31.941 s, runs | 4,104 tokens/s")
    assert not exact.search("predicted step 31.940 s\n4,104 tokens/s")  # `...` stays on its line
    varies = line_pattern("[#     ] step 1/20  loss 6.9636  ...  grad norm 4.677  tokens crc32 e7fcc33f", varies=True)
    assert varies.search("[####################] step 20/20  loss 3.7  35 ms  grad norm 80.073  tokens crc32 fa3ffc94")
    assert not varies.search("[#] step 1/20  loss 6.9  grad norm 4.6")  # words still count
    flag = line_pattern("dp_comm   8.1 ms   10.7 ms   +31.1%  <-- off by more than 25%", varies=True)
    assert flag.search("dp_comm  9.0 ms  9.5 ms  -5.2%")
    block = Block(ROOT / "README.md", 10, "bash", "$ a --x \\\n    --y\n  out 1\nerr\n$ b\nautopar: error: no", ())
    assert commands(block) == [Command("a --x \\\n    --y", 11, ((13, "out 1"), (14, "err"))),
                               Command("b", 15, ((16, "autopar: error: no"),))]
    assert commands(block)[1].should_fail
    plain = Block(ROOT / "README.md", 1, "bash", "# note\nrun 1 \\\n  --z\n  printed\nrun 2  # why", ())
    assert [(c.text, c.expected) for c in commands(plain)] == [("run 1 \\\n  --z", ((5, "printed"),)),
                                                              ("run 2  # why", ())]


_MENTION = re.compile(r"\bautopar (?P<sub>[a-z]+)\b|(?P<script>\b(?:examples|benchmarks)/\w+\.py)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def _script_flags(path: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))


def test_every_flag_the_docs_give_a_command_is_one_it_takes():
    """`autopar SUB ... --flag` and `examples/x.py --flag` (benchmarks too) in the prose as in the blocks: each
    flag is one that command's parser defines, so a renamed or removed flag cannot stay documented."""
    from autopar.cli.main import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict)).choices
    wrong = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().split("\n"), start=1):
            found = [m for m in _MENTION.finditer(line)  # a file.py:factory is a MODEL, not a command
                     if not (m.group("script") and line[m.end():m.end() + 1] == ":")]
            for k, m in enumerate(found):
                end = found[k + 1].start() if k + 1 < len(found) else len(line)
                segment = re.split(r"`|\||&&", line[m.end():end])[0]
                segment = re.sub(r"\"[^\"]*(\"|$)|'[^']*('|$)", "", segment)  # a quoted value: another tool's flags
                if m.group("sub"):
                    if m.group("sub") not in subs:
                        continue  # prose ("autopar answers ...")
                    known = {o for a in subs[m.group("sub")]._actions for o in a.option_strings}
                else:
                    known = _script_flags(ROOT / m.group("script"))
                wrong += [f"{path.name}:{number} {m.group()} {flag}" for flag in _FLAG.findall(segment)
                          if flag not in known]
    assert not wrong, f"flags the docs give commands that do not take them: {wrong}"


_CALL = re.compile(r"\b(?:autopar\.|pm\.)?(parallelize|plan|estimate|capture|PlannerOptions|ParallelConfig|train_step|"
                   r"eval_loss|local_batch)\(([^`]*?)\)")


def test_every_keyword_the_docs_give_the_api_is_one_it_takes():
    """`parallelize(..., max_grad_norm=1.0)`, `PlannerOptions(objective=...)` and the like, in prose and blocks:
    each keyword is a parameter of that function or a field of that class (README's max_grad_norm was not)."""
    import inspect

    import autopar
    from autopar.codegen.runtime import ParallelModel

    api = {name: getattr(autopar, name) for name in ("parallelize", "plan", "estimate", "capture", "PlannerOptions",
                                                      "ParallelConfig")}
    api |= {name: getattr(ParallelModel, name) for name in ("train_step", "eval_loss", "local_batch")}
    wrong, seen = [], 0
    for path in DOCS:
        for number, line in enumerate(path.read_text().split("\n"), start=1):
            for m in _CALL.finditer(line):
                params = inspect.signature(api[m.group(1)]).parameters
                for kw in re.findall(r"(?:^|[(,]\s*)(\w+)=", m.group(2)):
                    seen += 1
                    if kw not in params:
                        wrong.append(f"{path.name}:{number} {m.group(1)}({kw}=)")
    assert not wrong, f"keywords the docs give that the API does not take: {wrong}"
    assert seen >= 10, seen  # the prose's calls were found

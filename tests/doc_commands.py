"""The `rlbolt` commands the README and docs/ show in shell code blocks, as a user would type them
(read by tests/test_docs_commands.py).

A command is a `rlbolt demo|fit|resume|plot|export ...` in a fenced block that is not Python,
YAML, JSON or TOML: after `$ ` (a console transcript, whose following lines are its output),
after environment assignments, `srun`, `cd D &&` or an opening quote, and each side of `&&`.
Continuation lines (trailing backslash) are joined; `#` comments are dropped. A line that starts
with `rlbolt demo:` (a subcommand and a colon) is output the page quotes, not a command.
Commands in inline code spans are references to a command, not something to type, and are not
read: write a command a user should run in a shell block.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("demo", "fit", "resume", "plot", "export")
NOT_SHELL = ("python", "py", "yaml", "yml", "json", "toml", "text", "jsonl")
_COMMAND = re.compile(rf"(?:^|(?<=[\s;&\"'(]))rlbolt\s+(?:{'|'.join(SUBCOMMANDS)})(?=\s|$)")
_OUTPUT = re.compile(rf"^rlbolt (?:{'|'.join(SUBCOMMANDS)}):")


@dataclasses.dataclass(frozen=True)
class DocCommand:
    """One documented command: where it is, its arguments after `rlbolt`, and for a console
    transcript (`$ rlbolt ...`) the lines the page shows it printing."""

    where: str
    argv: tuple[str, ...]
    output: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        """The command as typed, normalised (`rlbolt` and single spaces between the words)."""
        return shlex.join(["rlbolt", *self.argv])


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a shell-like fenced block, continuations joined;
    each block ends with (its closing line's number, "") so a transcript ends with its block."""
    out, inside, lang, pending, start = [], False, "", "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if inside and lang not in NOT_SHELL:
                out.append((number, ""))
            inside, lang = (not inside), stripped[3:].strip().lower()
            continue
        if not inside or lang in NOT_SHELL:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def _commands_in(line: str) -> list[tuple[str, ...]]:
    found = []
    for match in _COMMAND.finditer(line):
        rest = re.split(r"&&|;|\|", line[match.start():], maxsplit=1)[0].strip().rstrip("&").strip()
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:  # the end of a quoted command (ssh --command="... rlbolt fit ...")
            words = shlex.split(rest[:-1], comments=True)
        found.append(tuple(words[1:]))
    return found


def documented_commands() -> list[DocCommand]:
    """Every documented command, in page order."""
    out: list[DocCommand] = []
    for page in pages():
        name = page.relative_to(ROOT).as_posix()
        console: DocCommand | None = None
        for number, line in _shell_lines(page.read_text(encoding="utf-8")):
            if line.startswith("$ "):
                if console is not None:
                    out.append(console)
                argv = _commands_in(line[2:])
                console = DocCommand(f"{name}:{number}", argv[0]) if argv else None
                continue
            if console is not None:
                if line:
                    console = dataclasses.replace(console, output=(*console.output, line))
                    continue
                out.append(console)
                console = None
            if _OUTPUT.match(line):
                continue
            out.extend(DocCommand(f"{name}:{number}", argv) for argv in _commands_in(line))
        if console is not None:
            out.append(console)
    return out

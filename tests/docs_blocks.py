"""The commands README.md and docs/*.md print, found by reading the documents (never listed by hand).

Shared by tests/test_docs.py (runs the cheap ones, checks the rest against the code) and
tests/newcomer.py (runs every one in a fresh venv, README top to bottom).

- A ```bash (or sh) block holds commands that run as printed. A comment line `# needs ...` before its
  first command marks the whole block as not runnable here (a Slurm cluster, a GPU), a trailing
  `# needs ...` comment marks one command; the reason is what follows `needs`.
- In any other block, a line starting `$ ` is a transcript: the command after it runs as printed.
- In any other block (but yaml and python), a line starting `axoplan ` is a synopsis: its options are
  checked against the command's own, its placeholders (M, N, [--quick], ...) are not run.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGS = ("bash", "sh", "shell", "console")
CODE_LANGS = ("yaml", "python", "json", "toml")
# axoplan commands the test suite runs for real: the planner's, each well under a few seconds
CHEAP = ("models", "profiles", "rank", "explain", "emit", "scale")
# how a shell command starts, for commands printed outside a bash block (which the test then refuses)
SHELL_START = re.compile(r"^(python3?|pip|pytest|torchrun|bash|srun|sbatch|export|cd|[A-Z_]+=\S+ )\b")


@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command's first line
    text: str  # as printed, continuations joined, the trailing comment removed
    kind: str  # "run" (bash block), "transcript" ($ line) or "synopsis"
    needs: str  # why it cannot run here ('' when it can)

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _split_comment(line: str) -> tuple[str, str]:
    """The command and its trailing comment (a # outside quotes, at the start or after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def _needs(comment: str) -> str:
    m = re.match(r"needs\s+(.+)", comment)
    return m.group(1).strip() if m else ""


def _logical_lines(lines: list[tuple[int, str]]):
    """(line number, text) with backslash continuations joined."""
    out, buf, start = [], "", 0
    for no, text in lines:
        if not buf:
            start = no
        if text.rstrip().endswith("\\"):
            buf += text.rstrip()[:-1] + " "
            continue
        out.append((start, buf + text))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def blocks(path: Path):
    """(language, first line number, [(line number, text)]) of every fenced block."""
    found, cur, lang, start = [], None, "", 0
    for no, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if text.startswith("```"):
            if cur is None:
                cur, lang, start = [], text[3:].strip().lower(), no
            else:
                found.append((lang, start, cur))
                cur = None
            continue
        if cur is not None:
            cur.append((no, text))
    return found


def commands(root: Path = ROOT) -> list[Command]:
    out = []
    for path in documents(root):
        doc = str(path.relative_to(root))
        for lang, _, lines in blocks(path):
            if lang in RUN_LANGS:
                block_needs, seen_command = "", False
                for no, text in _logical_lines(lines):
                    cmd, comment = _split_comment(text.strip())
                    if not cmd:
                        if not seen_command and _needs(comment):
                            block_needs = _needs(comment)
                        continue
                    seen_command = True
                    out.append(Command(doc, no, cmd, "run", block_needs or _needs(comment)))
            elif lang not in CODE_LANGS:
                joined = []
                for no, text in _logical_lines(lines):
                    # a synopsis wraps its optional part onto indented lines without a backslash
                    if joined and joined[-1][1].startswith("axoplan ") and re.match(r"\s+\[", text):
                        joined[-1] = (joined[-1][0], joined[-1][1] + " " + text.strip())
                    else:
                        joined.append((no, text))
                for no, text in joined:
                    cmd, _ = _split_comment(text)
                    if cmd.startswith("$ "):
                        out.append(Command(doc, no, cmd[2:].strip(), "transcript", ""))
                    elif cmd.startswith("axoplan "):
                        out.append(Command(doc, no, cmd.strip(), "synopsis", ""))
                    elif SHELL_START.match(cmd):  # a command outside a bash block: neither run nor marked
                        out.append(Command(doc, no, cmd.strip(), "untagged", ""))
    return out


def simple_commands(text: str) -> list[str]:
    """The simple commands of a shell line (split at &&, ||, ; and |)."""
    return [p.strip() for p in re.split(r"&&|\|\||;|\|", text) if p.strip()]


def words(simple: str) -> list[str]:
    """A simple command's words, redirections dropped."""
    ws = shlex.split(simple)
    out, skip = [], False
    for w in ws:
        if skip:
            skip = False
            continue
        if w in (">", ">>", "<", "2>", "2>&1"):
            skip = w != "2>&1"
            continue
        if re.match(r"^[0-9]?>>?\S+", w):
            continue
        if not out and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w):  # an environment prefix: NAME=value command
            continue
        out.append(w)
    return out


def axoplan_args(ws: list[str]) -> list[str] | None:
    """The arguments after the axoplan command itself (axoplan, python -m axoplan.cli, torchrun ... -m
    axoplan.cli), or None when the command is not axoplan."""
    if ws and ws[0] == "axoplan":
        return ws[1:]
    for i in range(len(ws) - 1):
        if ws[i] == "-m" and ws[i + 1] == "axoplan.cli":
            return ws[i + 2:]
    return None


def is_cheap(simple: str) -> bool:
    args = axoplan_args(words(simple))
    if not args or words(simple)[0] != "axoplan":
        return False
    return args[0] in CHEAP or (args[0] == "train" and "--print-config" in args)

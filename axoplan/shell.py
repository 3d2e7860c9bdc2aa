"""The one safe way to put values into emitted shell text (torchrun scripts, sbatch files, README
comments): every value is checked for control characters (a newline in a comment starts a command)
and then either quoted for the shell or written into a comment line."""
from __future__ import annotations

import re
import shlex

from axoplan.errors import UserError
from axoplan.inputs import text

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def quote(value, what: str) -> str:
    """value as one shell word: refused if it holds a control character, else single-quoted as needed."""
    return shlex.quote(text(str(value), what, allow_empty=True))


def join(words, what: str) -> str:
    """A command line of shell words, each quoted."""
    return " ".join(quote(w, what) for w in words)


def comment(line: str, what: str = "a script comment") -> str:
    """One `# ...` line: the text may say anything printable, but never end the comment."""
    return "# " + text(str(line), what, allow_empty=True)


def safe_line(line: str, what: str = "a line of emitted text") -> str:
    """A line of generated text (README, a directive) that must stay one line."""
    return text(str(line), what, allow_empty=True)


def slug(s: str) -> str:
    """A name for directives no shell parses (#SBATCH --job-name): letters, digits, '.', '_', '-'."""
    out = "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "-" for c in str(s))
    return out.strip("-") or "axoplan"


def env_name(name: str) -> str:
    """A variable name bash accepts in `export NAME=...` (ASCII letters, digits, underscore)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(f"launch environment variable name {name!r} is not a valid shell name")
    return name


def check_script(script: str, what: str = "an emitted script") -> str:
    """The last guard on a whole script: every line is printable text (a value that slipped through
    unquoted cannot add a line)."""
    for line in script.split("\n"):
        text(line, what, allow_empty=True)
    return script

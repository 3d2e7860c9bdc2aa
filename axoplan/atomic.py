"""The one way axoplan writes outputs: nothing a user produced is ever half-written or lost.

A regular file (or a symlink's regular target) is replaced atomically and keeps its mode; a device,
FIFO or other special file is written in place (never replaced by a regular file); a folder is refused.
Every failure is an OutputError: one sentence, exit code 2 in the CLI, and still an OSError for callers
that tell infrastructure failures apart.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from axoplan.errors import UserError


class OutputError(UserError, OSError):
    """An output that cannot be written (read-only file system, no permission, disk full, ...)."""


def _reason(e: OSError) -> str:
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return "a part of its folder path is a file, not a folder"
    return (e.strerror or str(e)).lower()


def _fail(path, e: OSError, what: str = "write") -> OutputError:
    err = OutputError(f"cannot {what} '{path}': {_reason(e)}")
    err.errno = e.errno
    return err


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def ensure_dir(path: str | Path) -> Path:
    """Create a folder (and its parents) for outputs, or say in one sentence why it cannot be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"cannot create the folder '{path}': a file of that name exists")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _fail(path, e, "create the folder") from None
    if not path.is_dir():
        raise OutputError(f"cannot create the folder '{path}': a file of that name exists")
    return path


def _target(path: Path) -> tuple[Path, os.stat_result | None]:
    """Where the bytes go: a symlink's final target (the link stays), else the path; with its stat."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise _fail(path, e) from None
    real = Path(os.path.realpath(path)) if path.is_symlink() else path
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write '{path}': it is a folder")
    if st is not None and stat.S_ISREG(st.st_mode) and not os.access(real, os.W_OK):
        # a file the user made read-only is protected on purpose: refuse rather than rename over it
        raise OutputError(f"cannot write '{path}': the file is read-only")
    return real, st


# the names of an already open file descriptor: /dev/stdout, /dev/fd/N, /proc/self/fd/N, /proc/PID/fd/N
_FD_NAME = re.compile(r"^/(?:dev/(?:stdin|stdout|stderr|fd/\d+)|proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd/\d+)$")


def _is_stream(path: Path) -> bool:
    """Whether path names an already open stream (maybe a file the shell opened with >>), written
    through, never renamed over: decided by following its links to a file-descriptor name, never by
    the folder it sits in (/dev/shm is an ordinary file system, its files are replaced like any)."""
    p = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if _FD_NAME.match(p):
            return True
        if not os.path.islink(p):
            return False
        try:
            p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
        except OSError:
            return False
    return False


def _write_in_place(path: Path, data: bytes) -> None:
    # a device or FIFO: replacing it with a regular file would destroy it (e.g. /dev/null as root)
    try:
        # append, never truncate: a device or FIFO ignores it, a file the shell opened with >> keeps its lines
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
    except OSError as e:
        raise _fail(path, e) from None


def _write_temp(target: Path, data: bytes, mode: int) -> str:
    """A complete, synced temporary file beside target (same file system, so the rename is atomic)."""
    ensure_dir(target.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise _fail(target, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except OSError as e:
        _unlink(tmp)
        raise _fail(target, e) from None
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def _mode(st: os.stat_result | None, default: int | None) -> int:
    if st is not None:
        return stat.S_IMODE(st.st_mode)  # a replaced file keeps its mode
    return (0o666 if default is None else default) & ~_umask()


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> Path:
    """Write data to path: atomically for a regular file (keeping its mode; `mode` for a new one),
    in place for a device or FIFO. Returns path."""
    path = Path(path)
    target, st = _target(path)
    if st is not None and (not stat.S_ISREG(st.st_mode) or _is_stream(path)):
        _write_in_place(path, data)  # through the link itself: /dev/stdout's target is no real path
        return path
    tmp = _write_temp(target, data, _mode(st, mode))
    try:
        os.replace(tmp, target)
    except OSError as e:
        _unlink(tmp)
        raise _fail(path, e) from None
    return path


def atomic_write_text(path: str | Path, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode(), mode)


def write_output(path: str | Path, data: str | bytes, mode: int | None = None) -> Path:
    """The one entry point for a single output file (text or bytes)."""
    return atomic_write_bytes(path, data.encode() if isinstance(data, str) else data, mode)


@contextmanager
def folder_lock(folder: str | Path):
    """Hold an exclusive lock on a folder (flock on the folder itself: no lock file is left behind), so
    two writers of one folder take turns instead of mixing their files."""
    d = ensure_dir(folder)
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise _fail(d, e, "open the folder") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield d
    finally:
        os.close(fd)  # closing releases the lock


def write_files(folder: str | Path, files: dict[str, tuple[str | bytes, int | None]]) -> dict[str, Path]:
    """Write a set of files into one folder as a unit: under the folder's lock, every file is first
    written completely beside its target, then all are renamed into place; if any write fails, none
    of them replaces anything. files: name -> (content, mode for a new file or None)."""
    out: dict[str, Path] = {}
    with folder_lock(folder) as d:
        staged: list[tuple[str, Path, Path]] = []  # (temp, target, path)
        try:
            for name, (data, mode) in files.items():
                path = d / name
                target, st = _target(path)
                raw = data.encode() if isinstance(data, str) else data
                if st is not None and (not stat.S_ISREG(st.st_mode) or _is_stream(path)):
                    out[name] = path  # special files are written last, in place
                    staged.append(("", target, path))
                    continue
                staged.append((_write_temp(target, raw, _mode(st, mode)), target, path))
            for (tmp, target, path), (data, _) in zip(staged, files.values()):
                if tmp:
                    try:
                        os.replace(tmp, target)
                    except OSError as e:
                        raise _fail(path, e) from None
                else:
                    _write_in_place(path, data.encode() if isinstance(data, str) else data)
                out[path.name] = path
        finally:
            for tmp, _, _ in staged:
                if tmp and os.path.exists(tmp):
                    _unlink(tmp)
    return out


def append_line(path: str | Path, line: str) -> None:
    """Append one line and flush it to disk, so an interrupted run keeps every finished record."""
    path = Path(path)
    ensure_dir(path.parent)
    try:
        with open(path, "a") as f:
            f.write(line.rstrip("\n") + "\n")
            f.flush()
            try:
                os.fsync(f.fileno())
            except OSError as e:
                if e.errno != errno.EINVAL:  # a device or FIFO cannot be synced; a file must be
                    raise
    except OSError as e:
        raise _fail(path, e) from None


def check_writable(path: str | Path, what: str) -> Path:
    """Refuse, before any work starts, an output file that could not be written later: a folder, a path
    under a file, a folder without write permission. Creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} '{path}' is a folder; give a file name")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{what} '{path}' cannot be written: a part of its folder path is a file, not a folder")
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        ok = os.access(path, os.W_OK)
    else:
        ok = os.access(parent, os.W_OK | os.X_OK) and (not path.exists() or os.access(path, os.W_OK))
    if not ok:
        raise OutputError(f"{what} '{path}' cannot be written: permission denied or read-only")
    if not path.exists() or stat.S_ISREG(path.stat().st_mode):
        # access() answers for permissions only (root passes every folder): a temporary file beside the
        # output, removed at once, finds a read-only mount, a full disk or a folder that refuses new files
        try:
            fd, tmp = tempfile.mkstemp(prefix=".axoplan-probe.", dir=parent)
        except OSError as e:
            raise OutputError(f"{what} '{path}' cannot be written: {_reason(e)}") from None
        os.close(fd)
        _unlink(tmp)
    return path

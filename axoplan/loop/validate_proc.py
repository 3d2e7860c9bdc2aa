"""Process control for `axoplan validate` (and `axoplan calibrate`): the lock on the folder a run
writes, the processes it starts, and ending those a killed run left behind.

A sweep holds an flock on OUT/sweep.lock for as long as it lives (the kernel drops it when the
process dies, even by kill -9), and records in that file its own pid and the process group of the
run it has started. Every run also carries AXOPLAN_VALIDATE_OUT=<the sweep folder> in its
environment, which torchrun passes on to its workers (even those in new sessions), so a later sweep
on the same folder finds every process an earlier one left running, by environment, not by parents.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from axoplan.errors import UserError

LOCK_FILE = "sweep.lock"
MARKER = "AXOPLAN_VALIDATE_OUT"


# ---- processes ---------------------------------------------------------------------------------
def proc_start(pid: int) -> str | None:
    """The start time of a live process (field 22 of /proc/PID/stat), None if gone or a zombie: with
    the pid it names one process, never a later one that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _pids() -> list[int]:
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live process below root, by parent links."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            st = proc_start(c)
            if st is not None:
                out.append((c, st))
                todo.append(c)
    return out


def marked(folder: Path, marker: str = MARKER) -> list[tuple[int, str]]:
    """(pid, start time) of every live process started for the sweep in folder (its environment
    carries the marker), this process and its ancestors excepted."""
    want = f"{marker}={folder}".encode() + b"\0"
    mine, p = {os.getpid()}, os.getppid()
    while p > 1 and p not in mine:  # a sweep started from inside a run must not end its own parents
        mine.add(p)
        p = _ppid(p)
    out = []
    for pid in _pids():
        if pid in mine:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if want in env or env.endswith(want[:-1]):
            st = proc_start(pid)
            if st is not None:
                out.append((pid, st))
    return out


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def end_processes(procs: list[tuple[int, str]], groups: list[int] = (), grace_s: float = 10.0) -> list[int]:
    """SIGTERM, then after grace_s SIGKILL, to the given processes (and process groups); returns the
    pids still alive at the end (none, unless they belong to someone we may not signal)."""
    def alive():
        return [(p, st) for p, st in procs if proc_start(p) == st]

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for g in groups:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p, _started in alive():
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        t_end = time.monotonic() + wait
        while alive() and time.monotonic() < t_end:
            time.sleep(0.05)
        if not alive():
            return []
    return [p for p, _ in alive()]


def kill_tree(proc: subprocess.Popen, grace_s: float = 10.0, folder: Path | None = None) -> None:
    """Stop a run started with start_new_session=True: SIGTERM to its group (torchrun forwards it to
    its workers), then SIGKILL to whatever of the tree (and of the processes marked for this sweep's
    folder) is left; the run's own process is reaped."""
    tree = descendants(proc.pid)
    if folder is not None:
        tree += [x for x in marked(folder) if x not in tree]
    me = proc_start(proc.pid)
    end_processes(tree + ([(proc.pid, me)] if me else []), groups=[proc.pid], grace_s=grace_s)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


# ---- the sweep's lock ------------------------------------------------------------------------------
class SweepLock:
    """An exclusive, non-blocking flock on OUT/sweep.lock, held while the sweep runs. The file says
    who holds it (pid, start time, host) and which run is under way (its process group and start
    time); a sweep that finds the lock free but the file naming runs reads what a dead sweep left."""

    def __init__(self, folder: str | Path, name: str = LOCK_FILE, what: str = "axoplan validate",
                 marker: str = MARKER, elsewhere: str = "choose another --out"):
        self.folder = Path(folder)
        self.path = self.folder / name
        self.what, self.marker, self.elsewhere = what, marker, elsewhere
        self.fd: int | None = None
        self.left: dict = {}  # what the previous holder recorded
        self.runs: list[dict] = []

    def acquire(self) -> SweepLock:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # O_CLOEXEC (Python's default) keeps the lock out of the runs we start: it dies with us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot lock the sweep folder '{self.folder}': {_reason(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_json_fd(fd)
            no_flock = e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
            # a file system without flock: the holder's pid and start time say whether it lives
            if not (no_flock and not _holder_alive(holder)):
                os.close(fd)
                if no_flock or e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    who = (f" (pid {holder['pid']} on {holder.get('host', '?')})"
                           if isinstance(holder.get("pid"), int) else "")
                    raise UserError(f"another {self.what}{who} is running in '{self.folder}'; wait for it to "
                                    f"finish or {self.elsewhere}") from None
                raise UserError(f"cannot lock the sweep folder '{self.folder}': {_reason(e)}") from None
        self.fd = fd
        self.left = _read_json_fd(fd)
        self._write()
        return self

    def _write(self) -> None:
        # written in place under the lock (a rename would give later sweeps another file to lock);
        # a record cut short by a crash is unreadable, and the environment marker still finds the runs
        rec = {"pid": os.getpid(), "start": proc_start(os.getpid()), "host": socket.gethostname(),
               "boot": _boot_id(), "runs": self.runs}
        data = (json.dumps(rec) + "\n").encode()
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, data, 0)
            os.fsync(self.fd)
        except OSError:
            pass  # the record helps find orphans; the environment marker finds them without it

    def started(self, pid: int, candidate: str = "") -> None:
        self.runs = [{"pgid": pid, "start": proc_start(pid), "candidate": candidate}]
        self._write()

    def finished(self) -> None:
        self.runs = []
        self._write()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

    def end_orphans(self, echo: Callable[[str], None] = print, grace_s: float = 10.0) -> int:
        """End every process an earlier sweep on this folder left running (it was killed, so nobody
        waits for them): they would share the cores and the run folder with the runs we start."""
        groups, procs = [], []
        # only a process carrying this folder's marker in its environment was started by a sweep here: the
        # lock file is plain text anyone can write, so what it names is signalled only if the kernel agrees
        ours = set(marked(self.folder.resolve(), self.marker))
        # start times count from boot: a record from another host or an earlier boot names no process here
        if self.left.get("host") == socket.gethostname() and self.left.get("boot") == _boot_id():
            for r in self.left.get("runs") or []:
                pgid, st = r.get("pgid"), r.get("start")
                if isinstance(pgid, int) and pgid > 1 and st is not None and (pgid, st) in ours:
                    groups.append(pgid)
                    procs.append((pgid, st))
                    procs += [x for x in descendants(pgid) if x in ours and x not in procs]
        elif self.left.get("runs") and self.left.get("host") != socket.gethostname():
            # a shared file system: what another host started cannot be seen, let alone ended, from here
            echo(f"warning: the {self.what} that last held {self.path} (on {self.left.get('host')}) died while run "
                 f"{self.left['runs'][0].get('candidate')} was under way; if that host is up, it may still be running")
        procs += [x for x in ours if x not in procs]
        if not procs:
            return 0
        runs = ", ".join(str(r.get("candidate")) for r in self.left.get("runs") or [] if r.get("candidate"))
        echo(f"ending {len(procs)} process(es) left running by an interrupted {self.what} in {self.folder}"
             + (f" (run {runs})" if runs else "") + ": pids " + " ".join(str(p) for p, _ in procs))
        left = end_processes(procs, groups=groups, grace_s=grace_s)
        if left:
            raise UserError(f"processes {' '.join(map(str, left))} of an interrupted {self.what} in '{self.folder}' are still "
                            f"running and cannot be ended from here; end them, then run again")
        return len(procs)


# ---- stopping (Ctrl-C, SIGTERM, SIGHUP) ---------------------------------------------------------------
class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the sweep: it stops as on Ctrl-C, ending the run under way."""


_stop = {"defer": False, "pending": None}


def _on_stop(signum, frame):
    if _stop["defer"]:  # between starting a run and being ready to end it: wait a moment
        _stop["pending"] = signum
        return
    _raise_stop(signum)


def _raise_stop(signum):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(f"signal {signum}")


def catch_stops() -> dict:
    """Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt here (so the run under way is ended); returns
    the handlers to restore. Not in the main thread: nothing changes."""
    handlers = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _on_stop)
    except ValueError:
        pass
    return handlers


def restore_stops(handlers: dict) -> None:
    for sig, h in handlers.items():
        signal.signal(sig, h)


def defer_stops(on: bool) -> None:
    """While on, a stop is held back (a run just started has no handle to end it by yet); turning it
    off raises the stop that came meanwhile."""
    _stop["defer"] = on
    if not on and _stop["pending"] is not None:
        signum, _stop["pending"] = _stop["pending"], None
        _raise_stop(signum)


# the lock of the sweep this process is running: run_one records its runs there
_active: SweepLock | None = None


def set_active(lock: SweepLock | None) -> None:
    global _active
    _active = lock


def active() -> SweepLock | None:
    return _active


def marker_env() -> dict:
    return {_active.marker: str(_active.folder.resolve())} if _active is not None else {}


def _holder_alive(holder: dict) -> bool:
    """Whether the process a lock record names runs still (here, since the same boot; same start)."""
    pid = holder.get("pid")
    return (isinstance(pid, int) and pid != os.getpid() and holder.get("host") == socket.gethostname()
            and holder.get("boot") == _boot_id() and holder.get("start") is not None
            and proc_start(pid) == holder.get("start"))


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _read_json_fd(fd: int) -> dict:
    try:
        data = os.pread(fd, 1 << 16, 0)
        rec = json.loads(data.decode())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _reason(e: OSError) -> str:
    return (e.strerror or str(e)).lower()


class FolderLock:
    """A non-blocking flock on a folder itself (no file is left in it), for a command whose processes
    carry `marker`=folder in their environment: `axoplan calibrate` on its results folder."""

    def __init__(self, folder: str | Path, what: str, marker: str, elsewhere: str):
        self.folder, self.what, self.marker, self.elsewhere = Path(folder), what, marker, elsewhere
        self.fd: int | None = None

    def __enter__(self):
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise UserError(f"cannot lock the folder '{self.folder}': {_reason(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(f"another {self.what} is running in '{self.folder}'; wait for it to finish"
                            + (f" or {self.elsewhere}" if self.elsewhere else "")) from None
        self.fd = fd
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def env(self) -> dict:
        return {self.marker: str(self.folder.resolve())}

    def end_orphans(self, echo: Callable[[str], None] = print, grace_s: float = 10.0) -> int:
        """End the processes a killed run on this folder left running (found by their environment)."""
        procs = marked(self.folder.resolve(), self.marker)
        if not procs:
            return 0
        echo(f"ending {len(procs)} process(es) left running by an interrupted {self.what} in {self.folder}: pids "
             + " ".join(str(p) for p, _ in procs))
        left = end_processes(procs, grace_s=grace_s)
        if left:
            raise UserError(f"processes {' '.join(map(str, left))} of an interrupted {self.what} in '{self.folder}' "
                            f"are still running and cannot be ended from here; end them, then run again")
        return len(procs)

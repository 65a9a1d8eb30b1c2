"""A directory written beside its destination and swapped in whole: an engine (`build`), a Triton model (`triton
export`). Whatever stops the writer, the destination holds the previous directory or the new one, never a mix.

Beside OUT, a writer makes `.OUT.WRITING-PID-HEX` and, replacing a previous OUT, sets that aside as
`.OUT.REPLACED-PID-HEX` for the moment of the two renames. It holds an flock on each one's `.lock` file while the
directory exists, so the next writer tells a killed writer's leftovers (lock free) from a live one's (held). A lock,
not the PID in the name: a writer in another container sharing the directory has PIDs of its own namespace, and one
of them once deleted a live build's half-written engine, which then wrote a manifest over what was left. The lock
goes with the process, SIGKILL included.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import re
import shutil
import signal
import stat
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_trt.signals import signal_handlers

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
# flock's errors on a file system without locks (NFS without lockd): there writers go unguarded, as before locks
LOCKLESS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP)
SWAP = "swap"  # `.OUT.swap.lock`: swaps into OUT take turns under it


def lock_of(path: Path) -> Path:
    """The lock file beside a writer's directory or a set-aside one."""
    return path.with_name(path.name + LOCK_SUFFIX)


def temp_beside(out: Path, kind: str) -> Path:
    """A new `.OUT.KIND-PID-HEX` path beside `out`."""
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextmanager
def held(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`.lock for the block, taken before `path` exists: while it is held, other writers
    beside it see `path` as a live writer's."""
    lock = lock_of(path)
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks (NFS without lockd): write unguarded, as before locks
            if e.errno not in LOCKLESS:
                os.close(fd)
                raise
            logger.warning("%s: no lock on this file system (%s): what a killed writer leaves here stays",
                           lock, e.strerror)
            break
        # a cleaner may have taken the file for an orphan and unlinked it between the open and the lock: lock anew
        if still_there(fd, lock):
            break
        os.close(fd)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def still_there(fd: int, lock: Path) -> bool:
    """Whether the open file `fd` is still the file at `lock`: a cleaner may unlink a free lock between another
    process's open and its flock, which then locks a file no one else will open."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock))
    except FileNotFoundError:
        return False


def lock_state(lock: Path) -> bool | None:
    """Whether `lock` is free (True: it exists and no process holds it), held (False), or cannot be told (None: no
    such file, or a file system whose locks this process cannot test), which neither clears nor waits on anything."""
    try:  # read-write where allowed: NFS emulates flock with byte-range locks, whose exclusive kind needs it
        fd = os.open(lock, os.O_RDWR)
    except PermissionError:  # another user's lock (0644): flock itself needs no more than reading
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            return None
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        return False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)


def _directories(parent: Path, kind: str, name: str | None = None) -> Iterator[tuple[Path, str]]:
    """(path, NAME) of the `.NAME.KIND-PID-HEX` directories in `parent` (NAME `name` only, unless None), matched
    whole: `.m.build-2.old-7-0123abcd` is m.build-2's set-aside directory, not a build of m."""
    whole = re.compile(rf"\.(.+)\.{re.escape(kind)}-\d+-[0-9a-f]{{8}}")
    pattern = f".{'*' if name is None else glob.escape(name)}.{kind}-*"
    for path in parent.glob(pattern):
        match = whole.fullmatch(path.name)
        if match and path.is_dir() and (name is None or match[1] == name):
            yield path, match[1]


def replace_file(path: str | Path, write: Callable[[Path], None], output: bool = False) -> None:
    """The file at `path` made whole, or left as it was: `write` fills a file beside it, which is then renamed over
    it (and removed where writing fails; a link at `path` is replaced, its target left alone).

    output: `path` is where the user asked a result written (`-o`): a symbolic link (/dev/stdout, a link of the
    user's), character device or FIFO there is written through in place, never renamed over (as root a rename
    replaced /dev/null with a file), the kernel's checks on opening it applying (fs.protected_symlinks in /tmp); other
    files that are not regular ones (a block device, a folder) are refused."""
    path = Path(path)
    if output and written_in_place(path):
        write(path)
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def written_in_place(path: Path) -> bool:
    """Whether replace_file(..., output=True) writes `path` through in place (a link, character device or FIFO)
    rather than replacing it (a regular file, or none yet); OSError for what is neither (a folder, a block device),
    or a link the kernel does not let this user follow."""
    try:
        mode = path.stat().st_mode  # through a link
    except (FileNotFoundError, NotADirectoryError):
        mode = None  # no file yet, or a link to none (a folder on the way that is a file is the writer's to name)
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
        raise OSError(errno.EINVAL, "not a regular file, character device or FIFO to write a result to", str(path))
    return path.is_symlink() or (mode is not None and not stat.S_ISREG(mode))


def set_aside(parent: Path, replaced: str, name: str) -> list[Path]:
    """The previous NAMEs a writer set aside in `parent` (as `replaced`), left there where it was killed before the
    new one took their place."""
    return sorted(path for path, _ in _directories(parent, replaced, name))


def live_writers(parent: Path, kind: str) -> list[Path]:
    """The directories of `kind` in `parent` that a live writer holds."""
    return sorted(path for path, _ in _directories(parent, kind) if lock_state(lock_of(path)) is False)


def remove_stale(parent: Path, writing: str, replaced: str, complete: Callable[[Path], bool],
                 name: str | None = None, unlocked_replaced: bool = False) -> None:
    """Clear what killed writers left in `parent`: directories being written (of any name: a killed writer of
    another name would otherwise keep its half-written copy until that name was written again) where their lock is
    left and free (a directory without one is not provably a writer's, say `.site.build-7-2024beef`); and set-aside
    previous directories (`name`'s only, unless None) whose lock is free, or absent where `unlocked_replaced` (the
    build's, whose writers before the lock left none), each going back to its place where the kill fell between the
    two renames (nothing there, and `complete` says it is whole) and deleted otherwise."""
    for tmp, _ in _directories(parent, writing):
        if lock_state(lock_of(tmp)):
            shutil.rmtree(tmp, ignore_errors=True)
    for old, out_name in _directories(parent, replaced, name):
        lock = lock_of(old)
        if not (lock_state(lock) or (unlocked_replaced and not lock.exists())):
            continue
        out = parent / out_name
        if not out.exists() and complete(old):
            old.rename(out)
            logger.warning("%s: put back what a killed writer had set aside", out)
        else:
            shutil.rmtree(old, ignore_errors=True)
    # Free locks whose directory is gone: removed above, or never made (a writer killed between the two). A lock
    # whose directory a partial removal left stays, so the next writer tries again.
    for kind in (writing, replaced):
        for lock in parent.glob(f".*.{kind}-*{LOCK_SUFFIX}"):
            if not lock.with_name(lock.name.removesuffix(LOCK_SUFFIX)).exists() and lock_state(lock):
                lock.unlink(missing_ok=True)
    for lock in parent.glob(f".*.{SWAP}{LOCK_SUFFIX}"):  # a swap killed before its lock went
        unlink_if_free(lock)


def unlink_if_free(lock: Path) -> None:
    """Unlink `lock` while holding it, where no process holds it: a writer that opened it meanwhile then finds it gone
    once it has the lock (still_there), and locks anew; unlinked after a free test instead, the name is one the next
    writer reuses, and it could take a lock another had just taken."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.unlink(missing_ok=True)
    except OSError:
        pass  # held: a swap in progress
    finally:
        os.close(fd)


def swap_in(tmp: Path, out: Path, replaced: str, check: Callable[[], None] | None = None) -> None:
    """Rename the finished `tmp` to `out`, setting a previous `out` aside as `replaced` and deleting it after; the
    previous one goes back where the second rename fails. `check` runs first, in the same block: another process
    may have written `out` meanwhile. SIGTERM, SIGINT and SIGHUP wait for the block, which would otherwise leave
    neither. Swaps into one `out` take turns (a lock named for it): two at once could each set aside what the other
    had just renamed in, and the slower one's rename then failed with a bare ENOTEMPTY."""
    with held(out.parent / f".{out.name}.{SWAP}"), signals_held():  # Ctrl-C still ends the wait for another swap
        if check is not None:
            check()
        if not out.exists():
            tmp.rename(out)
            return
        old = temp_beside(out, replaced)
        with held(old):
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:
                old.rename(out)
                raise
            shutil.rmtree(old, ignore_errors=True)


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP wait until the block ends, then act as they would have (one ignored, under nohup,
    stays ignored). Their handlers are swapped for ones that note them, not masked: a mask holds them on this thread
    alone, and the kernel gives a process's signal to any thread that takes it (torch's, once it has run)."""
    caught: list[int] = []

    def note(signum: int, frame) -> None:
        caught.append(signum)

    try:
        with signal_handlers(note, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # off the main thread: none set
            yield
    finally:
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)

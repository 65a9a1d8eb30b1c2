"""dir_swap: a directory is swapped in whole, and what killed writers left is told from live writers' by locks."""

import fcntl
import threading
from pathlib import Path

import pytest

from dflash_trt import dir_swap


def _whole(path: Path) -> bool:
    return (path / "done").is_file()


def _dir(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text(name)
    return path


def test_swap_in_replaces_whole_and_puts_the_previous_back_where_the_second_rename_fails(tmp_path, monkeypatch):
    out = _dir(tmp_path / "out", "done", "stale")
    dir_swap.swap_in(_dir(tmp_path / "new", "done"), out, "old")
    assert sorted(p.name for p in out.iterdir()) == ["done"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    real, calls = Path.rename, []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("injected")
        return real(src, dst)

    monkeypatch.setattr(Path, "rename", fail_second)
    with pytest.raises(OSError, match="injected"):
        dir_swap.swap_in(_dir(tmp_path / "newer", "other"), out, "old")
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["done"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["newer", "out"]  # the caller's to remove


def test_swaps_into_one_output_take_turns(tmp_path):
    """A second writer's check and renames wait for the first's: interleaved, each set aside what the other had just
    renamed in, and one failed with a bare rename error."""
    out = _dir(tmp_path / "out", "done")
    first_in, second_checked, seen = threading.Event(), threading.Event(), []

    def first_check():
        first_in.set()
        seen.append(second_checked.wait(timeout=1.0))  # the second writer's check must not run meanwhile

    def second():
        first_in.wait()
        dir_swap.swap_in(_dir(tmp_path / "b", "done", "b"), out, "old", check=second_checked.set)

    thread = threading.Thread(target=second)
    thread.start()
    dir_swap.swap_in(_dir(tmp_path / "a", "done", "a"), out, "old", check=first_check)
    thread.join()
    assert seen == [False]
    assert sorted(p.name for p in out.iterdir()) == ["b", "done"]  # the later swap wins, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _lock(path: Path) -> Path:
    path.with_name(path.name + ".lock").touch()  # left by a killed writer: no process holds it
    return path


def test_remove_stale_goes_by_locks_not_by_names_or_pids(tmp_path):
    killed = _lock(_dir(tmp_path / ".a.write-1-00000000", "half"))  # its lock left, free: a killed writer's
    unlocked = _dir(tmp_path / ".b.write-7-2024beef")  # no lock: not provably a writer's
    set_aside = _lock(_dir(tmp_path / ".c.replaced-2-00000000", "done"))  # killed between the renames: c goes back
    partial = _lock(_dir(tmp_path / ".d.replaced-3-00000000"))  # not whole: deleted, not put back
    # a set-aside directory of a name holding the writing kind is not a write in progress: it goes back too
    dotted = _lock(_dir(tmp_path / ".m.write-2.replaced-6-00000000", "done"))
    unlocked_old = _dir(tmp_path / ".g.replaced-8-00000000", "done")  # lock-less: left unless unlocked_replaced
    live = _dir(tmp_path / ".e.write-4-00000000")
    (tmp_path / ".k.swap.lock").touch()  # a swap killed between its renames: free
    with open(live.with_name(live.name + ".lock"), "w") as lock, open(tmp_path / ".l.swap.lock", "w") as swapping:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fcntl.flock(swapping, fcntl.LOCK_EX)  # a swap in progress
        assert dir_swap.live_writers(tmp_path, "write") == [live]
        dir_swap.remove_stale(tmp_path, "write", "replaced", complete=_whole)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [unlocked.name, "c", "m.write-2", unlocked_old.name, live.name, live.name + ".lock", ".l.swap.lock"])
    assert (tmp_path / "c" / "done").is_file() and (tmp_path / "m.write-2" / "done").is_file()
    assert not killed.exists() and not set_aside.exists() and not partial.exists() and not dotted.exists()
    # a set-aside directory is only `name`'s where one is given; lock-less ones count where the caller says so
    other = _lock(_dir(tmp_path / ".f.replaced-5-00000000", "done"))
    dir_swap.remove_stale(tmp_path, "write", "replaced", complete=_whole, name="g", unlocked_replaced=True)
    assert other.is_dir() and (tmp_path / "g" / "done").is_file() and not unlocked_old.exists()


def test_a_file_replaced_whole_is_left_as_it_was_where_writing_fails(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("before")
    dir_swap.replace_file(target, lambda tmp: tmp.write_text("after"))
    assert target.read_text() == "after"

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        dir_swap.replace_file(target, half_then_fail)
    assert target.read_text() == "after" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_an_output_link_is_written_through_and_a_fifo_in_place_never_renamed_over(tmp_path):
    """`bench speed -o /dev/stdout` as root replaced the device with a regular file; `-o link.json` the link."""
    import os
    import stat
    import threading

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("before")
    link.symlink_to(real)
    dir_swap.replace_file(link, lambda tmp: tmp.write_text("after"), output=True)
    assert link.is_symlink() and real.read_text() == "after"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_text()), daemon=True)
    reader.start()
    dir_swap.replace_file(fifo, lambda tmp: tmp.write_text("streamed"), output=True)
    reader.join(timeout=10)
    assert read == ["streamed"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "real.json"]
    (tmp_path / "folder").mkdir()
    (tmp_path / "to_folder").symlink_to(tmp_path / "folder")
    for path in (tmp_path / "folder", tmp_path / "to_folder"):  # nothing to write a result into, link or not
        with pytest.raises(OSError, match="not a regular file, character device or FIFO"):
            dir_swap.replace_file(path, lambda tmp: tmp.write_text("x"), output=True)


def test_dev_stdout_is_written_to_whatever_stdout_is():
    """-o /dev/stdout into a pipe (| jq): /dev/stdout links to /proc/self/fd/1, itself no path a rename could use."""
    import subprocess
    import sys

    code = ("from dflash_trt import dir_swap; dir_swap.replace_file('/dev/stdout', lambda p: p.write_text('{}'), "
            "output=True)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "{}", r.stderr


def test_a_file_of_the_project_s_own_replaces_a_link_and_leaves_its_target_alone(tmp_path):
    """A feature-cache index linked to another cache's (cp -rs) is replaced whole, never rewritten in the other."""
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("theirs")
    link.symlink_to(real)
    dir_swap.replace_file(link, lambda tmp: tmp.write_text("ours"))
    assert real.read_text() == "theirs" and not link.is_symlink() and link.read_text() == "ours"


def test_signals_sent_to_the_process_wait_for_the_held_block_then_act(ctrl_c_reaches_python):
    """A terminal's Ctrl-C goes to the process, and the kernel may hand it to any thread (torch's threads exist once
    it has run): held signals must wait whichever thread took them, and act once the block ends."""
    import os
    import signal
    import time

    import torch

    torch.ones(256, 256) @ torch.ones(256, 256)  # torch's worker threads
    done = []
    with pytest.raises(KeyboardInterrupt):
        with dir_swap.signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # its Python handler has run by now
            done.append("the block went on")
    assert done == ["the block went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back

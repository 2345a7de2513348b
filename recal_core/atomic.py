"""Write files atomically: a temp file beside the target, flushed to disk, renamed over it only on success.

A crash, an exception or a refused overwrite leaves no partial file and the old one intact. Temporaries carry the
writing process's id and a seal of it (``.recal-<pid>-<seal>-...``): a later write in the same folder removes those
whose process is gone (a killed conversion's), never another live process's, and never a file whose name lacks the
seal or that another user owns (a user's own ``.recal-1-notes`` stays).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

TEMP_PREFIX = ".recal-"  # every temporary file and folder recal writes starts so (stale ones are removable)
LOW_DISK_BYTES = 16 * 1024 * 1024


def _umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the process umask: the mode an ordinary ``open()`` would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


@contextlib.contextmanager
def _disk_full_is_said(folder: Path, target: Path) -> Iterator[None]:
    """A write that fails on a full disk raises one plain OSError saying so (torch and onnx report it
    in their own words, or as a RuntimeError)."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        full = getattr(exc, "errno", None) == errno.ENOSPC
        try:
            full = full or shutil.disk_usage(folder).free < LOW_DISK_BYTES
        except OSError:
            pass
        if full:
            raise OSError(errno.ENOSPC, f"no space left on the device of {folder} while writing {target.name}; "
                                        "nothing was written") from exc
        raise


@contextlib.contextmanager
def _said_as(temporary: Path, target: Path) -> Iterator[None]:
    """An error raised while writing names the user's ``target``, not recal's temporary (``.recal-<pid>-...``): the
    exception is re-raised as it is, its message and file name with the one path put for the other."""
    try:
        yield
    except Exception as exc:
        old, new = str(temporary), str(target)
        if exc.args and isinstance(exc.args[0], str) and old in exc.args[0]:
            exc.args = (exc.args[0].replace(old, new), *exc.args[1:])
        for attribute in ("filename", "filename2"):
            value = getattr(exc, attribute, None)
            if isinstance(value, str) and old in value:
                setattr(exc, attribute, value.replace(old, new))
        raise


def _seal(pid: int) -> str:
    """Eight hex digits only recal's temporaries carry after their process id."""
    return hashlib.blake2b(f"recal temporary of process {pid}".encode(), digest_size=4).hexdigest()


def _temp_prefix() -> str:
    return f"{TEMP_PREFIX}{os.getpid()}-{_seal(os.getpid())}-"


def _writer_pid(name: str) -> int | None:
    """The process id in a temporary's name (``.recal-<pid>-<seal>-...``), or None for any other name (one without
    the seal of its id is not recal's)."""
    if not name.startswith(TEMP_PREFIX):
        return None
    head, seal, *_ = name[len(TEMP_PREFIX):].split("-", 2) + ["", ""]
    return int(head) if head.isdigit() and seal == _seal(int(head)) else None


def made_by_recal(path: Path) -> bool:
    """Whether ``path`` is a temporary recal wrote: its name sealed (:func:`_writer_pid`), owned by this user."""
    try:
        owner = path.lstat().st_uid
    except OSError:
        return False
    return _writer_pid(path.name) is not None and owner == getattr(os, "getuid", lambda: owner)()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process: alive as far as we can tell
    return True


def remove_orphaned_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporaries in ``folder`` whose writing process no longer runs (a killed conversion's or run's);
    return them. Safe beside other live writers: their temporaries name a live process."""
    removed = []
    for item in Path(folder).glob(TEMP_PREFIX + "*"):
        pid = _writer_pid(item.name)
        if not made_by_recal(item) or pid == os.getpid() or _alive(pid):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)
        removed.append(item)
    return removed


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to the disk, so a rename never publishes unwritten data."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # a platform that cannot open folders: the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, *, protect: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """Yield a temporary path in ``target``'s folder; on success rename it to ``target``.

    Args:
        target: the file to write.
        protect: input paths that must never be overwritten (``ValueError`` if ``target`` is one of them).

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_path(d / "out.txt") as tmp:
    ...     _ = tmp.write_text("done")
    >>> (d / "out.txt").read_text()
    'done'
    """
    target = Path(target)
    if target.is_symlink():  # write where the link points, as cp does, rather than replace the user's link
        link = target
        target = Path(os.path.realpath(target))
        if not target.parent.is_dir():
            raise FileNotFoundError(f"output {link} is a symbolic link to {os.readlink(link)}, whose folder "
                                    f"{target.parent} does not exist")
    for p in protect:
        if Path(p).exists() and target.exists() and os.path.samefile(p, target):
            raise ValueError(f"refusing to overwrite the input {p}; choose another output path")
        if Path(os.path.abspath(p)) == Path(os.path.abspath(target)):
            raise ValueError(f"refusing to overwrite the input {p}; choose another output path")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"output folder {folder} does not exist")
    remove_orphaned_temporaries(folder)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{_temp_prefix()}{target.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with _said_as(tmp, target), _disk_full_is_said(folder, target):
            yield tmp
        os.chmod(tmp, _umask_mode())  # mkstemp makes 0600; outputs get the mode any new file would
        _fsync(tmp)
        os.replace(tmp, target)
        _fsync(folder)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(destination: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary folder inside ``destination``; on success move its files there.

    For writers that produce several files that refer to each other by name (an ONNX model and
    its external data): they are written under their final names, then moved (data files first,
    so a reader never sees a model whose data is missing). On failure nothing is moved.
    """
    destination = Path(destination) if str(destination) else Path(".")
    if not destination.is_dir():
        raise FileNotFoundError(f"output folder {destination} does not exist")
    remove_orphaned_temporaries(destination)
    folder = Path(tempfile.mkdtemp(prefix=_temp_prefix(), dir=destination))
    try:
        with _said_as(folder, destination), _disk_full_is_said(destination, folder):
            yield folder
        files = sorted(folder.iterdir(), key=lambda p: p.suffix == ".onnx")
        for item in files:
            _fsync(item)
        for item in files:
            os.replace(item, destination / item.name)
        _fsync(destination)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove recal's temporary files and folders left in ``folder`` by a killed process; return them.

    Call it only where no other recal process writes (e.g. under a run lock, as `recal train` holds one).
    """
    removed = []
    for item in Path(folder).glob(TEMP_PREFIX + "*"):
        if not made_by_recal(item):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        elif item.name.endswith(".tmp"):
            item.unlink(missing_ok=True)
        else:
            continue
        removed.append(item)
    return removed


def write_text_atomically(target: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``target`` whole or not at all; return its path.

    Args:
        target: the file to write.
        text: its content.
    """
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)

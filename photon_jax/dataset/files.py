"""The dataset side of `photon-caption`: which images there are, where each one's outputs
go, what counts as done on a re-run, and writes that a kill cannot tear.

Owns: finding the images (directories, globs, list files), the sidecar next to each image
or under an output folder mirroring the input tree, the JSONL of records, the rule that an
image is done when its sidecar exists (and, with a JSONL, its record says so), and
`OutputError`, the write failure that stops a run.

Records: an image's JSONL "path" is its absolute path, so a run resumes from any working
directory (relative paths, as earlier versions wrote them, are read against the current
one).  File names are bytes on POSIX and need not be UTF-8: such a name's "path" shows a
replacement character for each undecodable byte and "path_b64" holds its exact bytes, which
resume reads back; every line is strict UTF-8 JSON.

Crash safety: a sidecar is written in full to a fresh temporary file in its folder
(`mkstemp`: an unpredictable name, created exclusively, never through a planted symlink),
flushed to disk and renamed over, so it exists whole or not at all; the JSONL record is then
appended, the line written in full.  A kill can only tear the last JSONL line; the next run
cuts it off before appending, and removes temporary files a kill left.  An image whose
sidecar exists but whose JSONL record was lost that way is captioned again, so the two
outputs always agree and every image has exactly one successful JSONL record.  A write that
fails (a full disk) raises `OutputError` with the JSONL left in whole lines.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import glob
import json
import os
import re
import tempfile

IMAGE_EXTS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .apng .webp .bmp .dib .gif .tif .tiff .ppm .pgm .pbm .pnm "
    ".tga .ico .avif".split())
LIST_EXTS = frozenset((".txt", ".lst", ".list"))


class UsageError(Exception):
    """Bad command line or inputs: reported before any model is loaded (exit code 2)."""


# Errors of the disk rather than of one file: a sidecar failing with one of these stops the
# run (every later write would fail the same way); others fail that image alone.
DISK_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EROFS", "EIO")
                        if hasattr(errno, n))


class OutputError(Exception):
    """An output (a sidecar, the JSONL) could not be written: the run stops, names the file
    and says how to go on (`advice`)."""

    def __init__(self, path: str, err: OSError):
        self.path, self.err = path, err
        super().__init__(f"cannot write {shown(path)}: {err.strerror or err}")

    @property
    def advice(self) -> str:
        where = "(or point --output-dir / --jsonl elsewhere)"
        rerun = "and re-run to finish the remaining images; done ones are skipped"
        if self.err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", None)):
            return f"free some space on that disk {where} {rerun}"
        if self.err.errno == errno.EROFS:
            return f"that file system is read-only: make it writable {where} {rerun}"
        return f"fix that {where} {rerun}"


@dataclasses.dataclass(frozen=True)
class Item:
    """One input image: where it was found, its resume key, and the input root."""
    path: str   # as found (relative inputs stay relative); sidecars go beside it
    key: str    # absolute, normalised: the identity used to resume, the JSONL's "path"
    root: str   # the input it came from; --output-dir mirrors paths relative to it


# -- inputs -------------------------------------------------------------------------------

def is_image_name(name: str) -> bool:
    """-> True for a file name with an image extension (IMAGE_EXTS, any case)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def discover(inputs: list[str], recursive: bool = False, warn=print) -> list[Item]:
    """Expand inputs into images, in a stable order, each once.  A directory gives its image
    files (hidden ones skipped: `._x.jpg` resource forks are not images), a glob the image
    files it matches (`**` crosses directories), a file with an image extension itself, and
    a `.txt`/`.lst`/`.list` file its lines (one path each, relative to the list's folder;
    blank lines and `#` comments skipped; missing files fail one by one later)."""
    items: list[Item] = []
    seen: set[str] = set()

    def add(path: str, root: str) -> None:
        key = os.path.abspath(path)
        if key not in seen:
            seen.add(key)
            items.append(Item(path, key, root))

    for arg in inputs:
        before = len(items)
        if os.path.isdir(arg):
            for path in _scan(arg, recursive):
                add(path, arg)
        elif any(c in arg for c in "*?["):
            root = _glob_root(arg)
            for path in sorted(glob.glob(arg, recursive=True)):
                if os.path.isfile(path) and is_image_name(path):
                    add(path, root)
        elif os.path.isfile(arg):
            ext = os.path.splitext(arg)[1].lower()
            if ext in IMAGE_EXTS:
                add(arg, os.path.dirname(arg) or ".")
            elif ext in LIST_EXTS:
                base = os.path.dirname(arg) or "."
                for path in _read_list(arg):
                    add(os.path.join(base, path), base)
            else:
                raise UsageError(
                    f"input {arg!r} is neither an image ({', '.join(sorted(IMAGE_EXTS))}) nor "
                    "a list file (.txt/.lst/.list with one image path per line)")
        else:
            raise UsageError(f"input {arg!r} does not exist; give directories, globs (quote "
                             "them), image files or list files")
        if len(items) == before:
            warn(f"photon-caption: input {arg!r} has no images")
    return items


def _scan(folder: str, recursive: bool):
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if recursive else []
        for name in sorted(filenames):
            if not name.startswith(".") and is_image_name(name):
                yield os.path.join(dirpath, name)


def _glob_root(pattern: str) -> str:
    """The folder part of a glob before its first wildcard."""
    parts = pattern.split(os.sep)
    fixed = []
    for p in parts[:-1]:
        if any(c in p for c in "*?["):
            break
        fixed.append(p)
    return os.sep.join(fixed) or ("/" if pattern.startswith(os.sep) else ".")


def _read_list(path: str) -> list[str]:
    # surrogateescape: a name that is not UTF-8 passes through as its bytes, as os.listdir's.
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return [s.strip() for s in f if s.strip() and not s.lstrip().startswith("#")]


def sidecar_path(item: Item, output_dir: str | None, ext: str = ".txt") -> str:
    """`photo.jpg` -> `photo.txt` beside it, or under output_dir at the image's path relative
    to its input (an image outside that input goes to the top of output_dir)."""
    stem = os.path.splitext(item.path)[0]
    if output_dir is None:
        return stem + ext
    rel = os.path.relpath(os.path.splitext(item.key)[0], os.path.abspath(item.root))
    if rel.startswith(os.pardir):
        rel = os.path.basename(stem)
    return os.path.join(output_dir, rel + ext)


def check_collisions(items: list[Item], sidecars: list[str]) -> None:
    """Raise UsageError if two images would write the same sidecar file."""
    owner: dict[str, str] = {}
    clashes = []
    for it, sc in zip(items, sidecars):
        k = os.path.abspath(sc)
        if k in owner:
            clashes.append(f"{owner[k]!r} and {it.path!r} -> {sc!r}")
        owner.setdefault(k, it.path)
    if clashes:
        raise UsageError(
            f"{len(clashes)} pair(s) of images would share a sidecar (same name, other "
            f"extension), e.g. {clashes[0]}; rename them, or use --no-sidecar with --jsonl")


# -- outputs ------------------------------------------------------------------------------

TMP_SUFFIX = ".photon-tmp"
_TMP_RANDOM = re.compile(r"[a-z0-9_]{8}")   # mkstemp's random part


def shown(text: str) -> str:
    """-> text as valid Unicode: a file name's undecodable bytes (or any lone surrogate)
    become U+FFFD, so it can be printed and stored as strict UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:   # a name os.listdir decoded: one replacement per undecodable byte
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def record_path(key: str) -> dict:
    """An image's absolute path -> its record's naming fields: {"path"}, plus "path_b64"
    (base64 of the exact bytes) when the name is not UTF-8 and "path" is only readable."""
    raw = os.fsencode(key)
    try:
        return {"path": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return {"path": raw.decode("utf-8", "replace"),
                "path_b64": base64.b64encode(raw).decode("ascii")}


def record_key(rec: dict) -> str:
    """A JSONL record -> the resume key (`Item.key`) of its image, exactly.  Raises
    KeyError, TypeError or ValueError for something that is not a record."""
    if rec.get("path_b64") is not None:
        raw = base64.b64decode(rec["path_b64"], validate=True)
    else:
        path = rec["path"]
        if not isinstance(path, str):
            raise TypeError("path is not a string")
        # (surrogateescape: a "\udcXX" escape from another writer stands for that byte)
        raw = path.encode("utf-8", "surrogateescape")
    # A relative path (written by an earlier version) is read against the working
    # directory, as that version did.
    return os.path.abspath(os.fsdecode(raw))


def json_line(record: dict) -> bytes:
    """-> the record as one line of strict UTF-8 JSON (strings made valid by `shown`)."""
    clean = {k: shown(v) if isinstance(v, str) else v for k, v in record.items()}
    return (json.dumps(clean, ensure_ascii=False) + "\n").encode("utf-8")


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written: a write may take only part (a nearly full disk,
    a signal), and the rest must follow or the file is cut short."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:   # (no progress and no error: do not loop forever)
            raise OSError(errno.EIO, "write() wrote nothing")
        view = view[n:]


def _tmp_prefix(base: str) -> str:
    # Hidden (discover skips it) and tied to its file, so a later run can find it stale; the
    # name cut to 48 characters keeps the temporary name under NAME_MAX.
    return "." + base[:48] + "."


_FILE_MODE: int | None = None


def _file_mode() -> int:
    """The mode `open` would give a new file (0o666 less the umask): mkstemp's are 0o600."""
    global _FILE_MODE
    if _FILE_MODE is None:
        mask = None
        try:   # Linux: read the umask without changing it (other threads create files)
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("Umask:"):
                        mask = int(line.split()[1], 8)
        except (OSError, ValueError, IndexError):
            pass
        if mask is None:
            mask = os.umask(0o022)
            os.umask(mask)
        _FILE_MODE = 0o666 & ~mask
    return _FILE_MODE


def write_atomic(path: str, data: str | bytes) -> None:
    """The file holds the old content or the new, never a part: write a fresh temporary file
    (`mkstemp`) in the same folder in full, flush it to disk, rename it over.  Text is
    stored as UTF-8.  Raises OSError, the temporary file removed."""
    if isinstance(data, str):
        data = shown(data).encode("utf-8")
    folder, base = os.path.split(path)
    folder = folder or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(base), suffix=TMP_SUFFIX, dir=folder)
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, _file_mode())
            write_all(fd, data)
            os.fsync(fd)   # on disk before the rename: a crash leaves old or new, not empty
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def remove_stale_temps(paths) -> int:
    """Remove the temporary files that a killed run left for these outputs (`write_atomic`'s,
    and the fixed `<file>.photon-tmp` of earlier versions; a symlink is removed, never
    followed) -> how many.  One listing per folder; run before any writing starts."""
    folders: dict[str, tuple[set, set]] = {}
    for p in paths:
        folder, base = os.path.split(p)
        legacy, prefixes = folders.setdefault(folder or ".", (set(), set()))
        legacy.add(base + TMP_SUFFIX)
        prefixes.add(_tmp_prefix(base))
    removed = 0
    for folder, (legacy, prefixes) in folders.items():
        try:
            names = os.listdir(folder)
        except OSError:   # not created yet, or unreadable: nothing of ours to remove
            continue
        for name in names:
            if not name.endswith(TMP_SUFFIX):
                continue
            stem = name[:-len(TMP_SUFFIX)]
            if name in legacy or (_TMP_RANDOM.fullmatch(stem[-8:]) and stem[:-8] in prefixes):
                try:
                    os.unlink(os.path.join(folder, name))
                    removed += 1
                except OSError:   # a folder of that name, or gone: not ours to force
                    pass
    return removed


class Jsonl:
    """The JSONL output: read back for resume (torn last line repaired), appended one whole
    line per image (O_APPEND), so a kill tears at most that line and a failed write leaves
    none of it.  Write failures raise `OutputError`."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UsageError(f"--jsonl {shown(self.path)}: cannot read it: "
                             f"{e.strerror or e}") from None

    def load(self, warn=print) -> set[str]:
        """The images (their keys: absolute paths) with a successful record.  Cuts off a
        torn last line (no newline at the end) so the next append starts on its own line."""
        ok: set[str] = set()
        data = self._read()
        if data is None:
            return ok
        end = data.rfind(b"\n") + 1
        if end < len(data):
            warn(f"photon-caption: {shown(self.path)}: dropping a torn last line "
                 f"({len(data) - end} bytes) left by an interrupted run")
            try:
                os.truncate(self.path, end)
            except OSError as e:
                raise OutputError(self.path, e) from None
        for n, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if rec.get("error") is None:
                    ok.add(record_key(rec))
            except (ValueError, KeyError, TypeError, AttributeError):
                warn(f"photon-caption: {shown(self.path)}:{n}: not a record, ignored")
        return ok

    def drop(self, keys: set[str]) -> None:
        """Remove the records of these images (for --overwrite), by rewriting atomically."""
        data = self._read()
        if data is None:
            return
        keep = [ln for ln in data.splitlines(keepends=True) if not _record_of(ln, keys)]
        try:
            write_atomic(self.path, b"".join(keep))
        except OSError as e:
            raise OutputError(self.path, e) from None

    def append(self, record: dict) -> None:
        line = json_line(record)
        try:
            if self.fd is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            start = os.lseek(self.fd, 0, os.SEEK_END)
            try:
                write_all(self.fd, line)
            except OSError:
                try:   # leave whole lines only: cut off the part that was written
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass   # (the next run's load cuts a torn line off)
                raise
        except OSError as e:
            raise OutputError(self.path, e) from None

    def close(self) -> None:
        """Flush the records to disk and close (a full disk may only show here)."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise OutputError(self.path, e) from None


def _record_of(line: bytes, keys: set[str]) -> bool:
    try:
        return record_key(json.loads(line)) in keys
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def is_done(it: Item, sidecar: str | None, jsonl, recorded: set[str]) -> bool:
    ok = it.key in recorded
    if sidecar is None:
        return ok
    return os.path.exists(sidecar) and (jsonl is None or ok)

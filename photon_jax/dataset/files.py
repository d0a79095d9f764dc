"""The dataset side of `photon-caption`: which images there are, where each one's outputs
go, what counts as done on a re-run, and writes that a kill cannot tear.

Owns: finding the images (directories, globs, list files), the sidecar next to each image
or under an output folder mirroring the input tree, the JSONL of records, and the rule that
an image is done when its sidecar exists (and, with a JSONL, its record says so).

Crash safety: a sidecar is written to a temporary file and renamed over (so it exists whole
or not at all); the JSONL record is then appended with one `write` of one line.  A kill can
only tear the last JSONL line; the next run cuts it off before appending.  An image whose
sidecar exists but whose JSONL record was lost that way is captioned again, so the two
outputs always agree and every image has exactly one successful JSONL record.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

IMAGE_EXTS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .apng .webp .bmp .dib .gif .tif .tiff .ppm .pgm .pbm .pnm "
    ".tga .ico .avif".split())
LIST_EXTS = frozenset((".txt", ".lst", ".list"))


class UsageError(Exception):
    """Bad command line or inputs: reported before any model is loaded (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Item:
    """One input image: where it was found, its resume key, and the input root."""
    path: str   # as found (relative inputs stay relative); the JSONL's "path"
    key: str    # absolute, normalised: the identity used to resume
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
    with open(path, encoding="utf-8") as f:
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

def write_atomic(path: str, text: str) -> None:
    """The file holds the old content or the new, never a part: write a temporary file in
    the same folder, flush it to disk, rename it over."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".photon-tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Jsonl:
    """The JSONL output: read back for resume (torn last line repaired), appended one line
    per image with a single `write` (O_APPEND), so a kill tears at most that line."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def load(self, warn=print) -> set[str]:
        """The images (absolute paths) with a successful record.  Cuts off a torn last line
        (no newline at the end) so the next append starts on a line of its own."""
        ok: set[str] = set()
        if not os.path.exists(self.path):
            return ok
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            warn(f"photon-caption: {self.path}: dropping a torn last line "
                 f"({len(data) - end} bytes) left by an interrupted run")
            os.truncate(self.path, end)
        for n, line in enumerate(data[:end].splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if rec.get("error") is None:
                    ok.add(os.path.abspath(rec["path"]))
            except (ValueError, KeyError, TypeError):
                warn(f"photon-caption: {self.path}:{n}: not a record, ignored")
        return ok

    def drop(self, keys: set[str]) -> None:
        """Remove the records of these images (for --overwrite), by rewriting atomically."""
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            keep = [ln for ln in f if not _record_of(ln, keys)]
        write_atomic(self.path, "".join(keep))

    def append(self, record: dict) -> None:
        if self.fd is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self.fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = None


def _record_of(line: str, keys: set[str]) -> bool:
    try:
        return os.path.abspath(json.loads(line)["path"]) in keys
    except (ValueError, KeyError, TypeError):
        return False


def is_done(it: Item, sidecar: str | None, jsonl, recorded: set[str]) -> bool:
    ok = it.key in recorded
    if sidecar is None:
        return ok
    return os.path.exists(sidecar) and (jsonl is None or ok)

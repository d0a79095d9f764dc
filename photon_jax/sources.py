"""Where a model comes from: turns what `Moondream.load` and `photon-caption --model` are given
into a photon_jax checkpoint directory.

Owns: telling the kinds of source apart, resolving Hugging Face hub ids, finding the starmie
tokenizer, and the per-user cache of converted snapshots.  Three kinds of source:

1. a directory written by `photon-convert` (`params/` + `config.json`): used as it is;
2. a Hugging Face snapshot directory (`config.json` + `model.safetensors` or a sharded
   `model.safetensors.index.json`, e.g. from `hf download vikhyatk/moondream2 --revision
   2025-06-21 --local-dir md2`): converted on first use into the cache below;
3. a hub id such as "vikhyatk/moondream2" (with an optional `revision`: branch, tag or
   commit), when it is not a local directory: resolved with `huggingface_hub.snapshot_download`
   (the optional extra `photon_jax[hf]`; only the config, weights, index and tokenizer are
   fetched, into the usual Hugging Face cache, and nothing when that cache has them or
   `HF_HUB_OFFLINE=1`), then converted like 2.  Gated repos (moondream/moondream3-preview)
   need their terms accepted on the hub and a token (`hf auth login` or `HF_TOKEN`).

Nothing is resolved or downloaded at import.

The tokenizer: the snapshot's own `tokenizer.json` when it is the starmie one (checked as the
converter checks it); otherwise (missing, or the older GPT-2 one that Moondream 2 snapshots
may still carry) `tokenizer.json` of moondream/starmie-v1 from the local Hugging Face cache
($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub), else downloaded from the hub
when huggingface_hub is installed and `HF_HUB_OFFLINE` is not set.  When none has it, the error
names the file to fetch and where to put it.

The cache: `$PHOTON_JAX_CACHE`, else `$XDG_CACHE_HOME/photon_jax/checkpoints`, else
`~/.cache/photon_jax/checkpoints`; one directory `<dtype>-<key>` per converted snapshot, safe
to delete at any time (the next load converts again).  The key is the sha256 of what the
conversion reads and of what it does: the sha256 of every source file (config.json, the index,
each weights file, the tokenizer used), the storage dtype, the converter's version and the
checkpoint format version.  Full content hashes, because anything cheaper (names, shapes, sizes,
safetensors headers) is identical for a fine-tune of the same model and would hand it the
wrong weights; the snapshot's path is left out, so the same files under the Hugging Face cache,
a `--local-dir` copy or another revision share one entry.  The hashes stay cheap: a weights
file's hash is remembered (in `.hashes/`) under its real path, size, inode and modification
and change times, so only the first load of a file reads it; later loads only `stat` it.
A conversion streams as `photon-convert` does, into a temporary directory inside the cache that
is renamed into place when complete (a killed conversion leaves no entry, and its leftovers
are removed by the next conversion of the same snapshot); a lock file keeps two processes
from converting the same snapshot at once.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time

STARMIE_REPO = "moondream/starmie-v1"
# What a conversion needs of a hub repo; anything else it holds (other formats, code) is not
# downloaded.
HUB_PATTERNS = ["config.json", "tokenizer.json", "model.safetensors.index.json",
                "model*.safetensors"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_MEMO_MIN_BYTES = 64 << 20   # hashes of files this big are remembered in .hashes/


class SourceError(ValueError):
    """The model source cannot be used: not found, not downloadable, no tokenizer."""


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_line(e: BaseException) -> str:
    """An error's message on one line (the converter lists problems on indented lines)."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    if not lines:
        return type(e).__name__
    rest = [s[2:] if s.startswith("- ") else s for s in lines[1:]]
    return " ".join([lines[0], "; ".join(rest)]) if rest else lines[0]


def errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "this source is bad" (for the CLI's exit code 2)."""
    from .model.checkpoint import CheckpointError
    from .convert import ConvertError
    from .convert.safetensors_io import SafetensorsError
    from .model.tokenizer import TokenizerError

    return SourceError, ConvertError, CheckpointError, TokenizerError, SafetensorsError


# -- where things are ---------------------------------------------------------------------


def cache_dir() -> str:
    """The converted-checkpoint cache (see the module docstring)."""
    d = os.environ.get("PHOTON_JAX_CACHE")
    if not d:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
        d = os.path.join(xdg, "photon_jax", "checkpoints")
    return os.path.abspath(os.path.expanduser(d))


def hf_hub_cache() -> str:
    """The Hugging Face hub cache, by huggingface_hub's rules, read from the environment now
    (huggingface_hub reads it once, at its import)."""
    d = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not d:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
        d = os.path.join(home, "hub")
    return os.path.abspath(os.path.expanduser(os.path.expandvars(d)))


def hf_offline() -> bool:
    """-> True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value."""
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def is_photon_checkpoint(path: str) -> bool:
    """-> True for a directory written by photon-convert (config.json + params/)."""
    return (os.path.isdir(os.path.join(path, "params"))
            and os.path.isfile(os.path.join(path, "config.json")))


def looks_like_hub_id(s: str) -> bool:
    """-> True for an "org/name" string that could be a Hugging Face repository id."""
    return bool(_HUB_ID.fullmatch(s)) and ".." not in s


# -- the entry point ----------------------------------------------------------------------


def resolve(source, *, revision: str | None = None, dtype=None, log=None) -> str:
    """A photon_jax checkpoint directory for `source` (see the module docstring): the
    directory itself, or the cache entry of the snapshot, converted now if it is not there.

    dtype (as `Moondream.load`'s): "float32" converts a snapshot to a float32 entry,
    "bfloat16" to a bfloat16 one; None keeps bfloat16 weights in bfloat16 and converts
    float16/float32 ones to float32 (exact)."""
    log = log or _stderr
    path = os.path.expanduser(os.fspath(source))
    if os.path.isdir(path):
        if revision is not None:
            raise SourceError(f"revision {revision!r} applies to a Hugging Face hub id; {path} "
                              "is a local directory")
        if is_photon_checkpoint(path):
            from .model.checkpoint import read_config

            read_config(path)   # a wrong format version is refused here, with its message
            return path
        from .model.checkpoint import is_hf_snapshot, read_config

        if is_hf_snapshot(path) or os.path.isfile(os.path.join(path, "config.json")):
            return converted(path, dtype=dtype, log=log)
        read_config(path)   # raises: not a photon_jax checkpoint nor a snapshot
    if os.path.exists(path):
        raise SourceError(f"{path} is a file; give a directory written by photon-convert, a "
                          "Hugging Face snapshot directory or a hub id such as "
                          "vikhyatk/moondream2")
    if looks_like_hub_id(path):
        return converted(hub_snapshot(path, revision=revision), dtype=dtype, log=log)
    raise SourceError(f"model not found: {path} is not a directory (a photon-convert output or "
                      "a Hugging Face snapshot), nor a hub id such as vikhyatk/moondream2")


# -- hub ids ------------------------------------------------------------------------------


def hub_snapshot(repo_id: str, *, revision: str | None = None) -> str:
    """The local snapshot directory of `repo_id` at `revision` (default: main), downloading
    what is missing unless offline."""
    at = f"{repo_id}" + (f" (revision {revision})" if revision else "")
    get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        import huggingface_hub as hf
    except ImportError:
        raise SourceError(
            f"{repo_id} is not a local directory; to load it as a Hugging Face hub id install "
            f"huggingface_hub (pip install 'photon_jax[hf]'), or download it yourself "
            f"({get} --local-dir DIR) and give DIR") from None
    from huggingface_hub import errors as hfe

    offline = hf_offline()
    try:
        return hf.snapshot_download(repo_id, revision=revision, cache_dir=hf_hub_cache(),
                                    allow_patterns=HUB_PATTERNS, local_files_only=offline)
    except hfe.GatedRepoError:
        raise SourceError(
            f"{repo_id} is gated: accept its terms on its Hugging Face page, then log in with "
            "`hf auth login` or set HF_TOKEN, and load it again") from None
    except hfe.RepositoryNotFoundError:
        raise SourceError(
            f"{repo_id} is not a local directory, and the Hugging Face hub has no repo "
            f"{repo_id} (a private one needs `hf auth login` or HF_TOKEN)") from None
    except hfe.RevisionNotFoundError:
        raise SourceError(f"the Hugging Face repo {repo_id} has no revision {revision!r}") \
            from None
    except hfe.LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE is set" if offline else
               "the hub cannot be reached: " + one_line(e.__cause__ or e))
        raise SourceError(
            f"{repo_id} is not a local directory, and {at} is not (completely) in the Hugging "
            f"Face cache {hf_hub_cache()} and cannot be downloaded now ({why}); download it "
            f"with `{get}` where the hub can be reached") from None
    except hfe.HFValidationError as e:
        raise SourceError(f"{repo_id!r}: not a local directory, nor a valid hub id ({e})") \
            from None
    except Exception as e:  # noqa: BLE001 - HTTP and connection errors, disk full, ...
        raise SourceError(f"cannot fetch {at} from the Hugging Face hub: "
                          f"{type(e).__name__}: {one_line(e)}") from None


# -- the tokenizer ------------------------------------------------------------------------


def _in_hf_cache(path: str) -> bool:
    parts = os.path.abspath(path).split(os.sep)
    return (len(parts) >= 3 and parts[-2] == "snapshots"
            and parts[-3].startswith(("models--", "datasets--")))


def _starmie_in_cache() -> str | None:
    cache = hf_hub_cache()
    try:
        from huggingface_hub import try_to_load_from_cache

        p = try_to_load_from_cache(STARMIE_REPO, "tokenizer.json", cache_dir=cache)
        if isinstance(p, str) and os.path.isfile(p):
            return p
    except ImportError:
        pass
    # The cache layout, read directly: refs/main's snapshot first, then the newest other.
    repo = os.path.join(cache, "models--" + STARMIE_REPO.replace("/", "--"))
    found = sorted(glob.glob(os.path.join(repo, "snapshots", "*", "tokenizer.json")),
                   key=lambda p: os.path.getmtime(p), reverse=True)
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            main = os.path.join(repo, "snapshots", f.read().strip(), "tokenizer.json")
        found = [main] + found if os.path.isfile(main) else found
    except OSError:
        pass
    return found[0] if found else None


def _starmie_download() -> tuple[str | None, str]:
    """(path, "") or (None, why not)."""
    if hf_offline():
        return None, "HF_HUB_OFFLINE is set, so it was not downloaded"
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None, ("huggingface_hub is not installed (pip install 'photon_jax[hf]'), so it "
                      "was not downloaded")
    try:
        return hf_hub_download(STARMIE_REPO, "tokenizer.json", cache_dir=hf_hub_cache()), ""
    except Exception as e:  # noqa: BLE001 - any failure is reported in the error below
        return None, f"downloading it failed: {type(e).__name__}: {one_line(e)}"


def find_tokenizer(snapshot: str) -> tuple[str, str]:
    """(the tokenizer.json to convert with, a note on where it came from: "" when it is the
    snapshot's own).  Raises SourceError naming the file to fetch when none is found."""
    from .model.tokenizer import STARMIE_HINT, TokenizerError, load_tokenizer

    from .convert.safetensors_io import snapshot_file

    # Raises when the snapshot's tokenizer.json is a symlink out of it (the converter's rule).
    own = snapshot_file(snapshot, "tokenizer.json")
    problem = f"{snapshot} has no tokenizer.json"
    if os.path.isfile(own):
        try:
            load_tokenizer(own)
            return own, ""
        except TokenizerError as e:
            problem = str(e).replace(STARMIE_HINT, "").strip().rstrip(";.").strip()
    why = "it is not in the Hugging Face cache " + hf_hub_cache()
    cached = _starmie_in_cache()
    fetched, reason = (None, "") if cached else _starmie_download()
    if reason:
        why += f" and {reason}"
    for p in (cached, fetched):
        if p is not None:
            try:
                load_tokenizer(p)
                return p, f"{problem}; using {STARMIE_REPO}'s {p}"
            except TokenizerError as e:
                why = f"{p} is not usable either ({e})"
    where = ("(it goes into the Hugging Face cache, where photon_jax looks for it)"
             if _in_hf_cache(snapshot) else f"--local-dir {snapshot}")
    raise SourceError(
        f"{problem}, and Moondream 2 (2025-06-21) and 3 need the starmie tokenizer of "
        f"{STARMIE_REPO}; {why}.  Fetch it with: hf download {STARMIE_REPO} tokenizer.json "
        f"{where}")


# -- the cache ----------------------------------------------------------------------------


def content_sha256(path: str) -> str:
    """sha256 of a file's bytes; remembered for big files under their real path, size, inode
    and times, so only the first call reads them."""
    from .convert.convert import sha256_file

    real = os.path.realpath(path)
    st = os.stat(real)
    if st.st_size < _MEMO_MIN_BYTES:
        return sha256_file(real)
    stamp = f"{real}\0{st.st_size}\0{st.st_ino}\0{st.st_dev}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    memo = os.path.join(cache_dir(), ".hashes", hashlib.sha256(stamp.encode()).hexdigest()[:40])
    try:
        with open(memo) as f:
            digest = f.read().strip()
        if re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    except OSError:
        pass
    digest = sha256_file(real)
    try:   # best effort: without the memo the next load hashes again
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(memo), prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(digest)
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def _weights(snapshot: str):
    """(tensor refs, weight files), or (None, []) when the converter will refuse them."""
    from .convert.convert import index_weights

    try:
        return index_weights(snapshot)
    except ValueError:    # SafetensorsError, TorchZipError
        return None, []


def storage_dtype(dtype, tensors) -> str:
    """-> the dtype a converted snapshot is stored in: the one asked for, else bfloat16 for
    bf16 weights and float32 for float16 / float32 ones."""
    if dtype is not None:
        from .base.dtypes import canonical

        try:
            return canonical(dtype)
        except ValueError as e:
            raise SourceError(str(e)) from None
    # Codes and scales of published quantized weights (int4 packs, fp8 experts) say nothing
    # of the float weights' dtype: those stay as they are whatever the storage dtype.
    floats = [] if tensors is None else [
        r.dtype for n, r in tensors.items()
        if r.dtype in ("F32", "F16", "BF16") and not n.endswith(_QUANT_SIDECARS)]
    if all(d == "BF16" for d in floats):
        return "bfloat16"
    return "float32"   # float16 / float32 weights: float32 is exact


_QUANT_SIDECARS = (".scale", ".zero_point", "up_scale", "down_scale")


def cache_key(snapshot: str, files: list[str], tokenizer: str, dtype: str) -> str:
    """-> the converted-cache entry name of a snapshot: a sha256 over its files' contents,
    the tokenizer's, the dtype and the converter and format versions."""
    from .model.config import FORMAT_VERSION
    from .convert.convert import CONVERTER_VERSION

    def sha(p):
        return content_sha256(p) if os.path.isfile(p) else None

    parts = {
        "converter_version": CONVERTER_VERSION,
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "config.json": sha(os.path.join(snapshot, "config.json")),
        "index": sha(os.path.join(snapshot, "model.safetensors.index.json")),
        "weights": {os.path.basename(p): sha(p) for p in files},
        "tokenizer": sha(tokenizer),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _convert(hf_dir: str, out_dir: str, **kw):
    """The converter (one place, so tests can count its calls)."""
    from .convert import convert

    return convert(hf_dir, out_dir, **kw)


@contextlib.contextmanager
def _locked(path: str):
    try:
        import fcntl
    except ImportError:   # no flock (Windows): the atomic rename still keeps entries whole
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted(snapshot: str, *, dtype=None, log=None) -> str:
    """The cache entry of `snapshot` converted to `dtype` (see `resolve`), converting it now if
    it is not there yet."""
    log = log or _stderr
    from .convert.safetensors_io import snapshot_file

    # config.json and the index are hashed for the cache key before the converter reads
    # them: refuse first, as it would, any that is a symlink out of the snapshot.
    for name in ("config.json", "model.safetensors.index.json"):
        snapshot_file(snapshot, name)
    tokenizer, note = find_tokenizer(snapshot)
    tensors, files = _weights(snapshot)
    dt = storage_dtype(dtype, tensors)
    root = cache_dir()
    name = f"{dt}-{cache_key(snapshot, files, tokenizer, dt)[:32]}"
    final = os.path.join(root, name)
    if is_photon_checkpoint(final):
        return final
    os.makedirs(root, exist_ok=True)
    with _locked(os.path.join(root, f".{name}.lock")):
        if is_photon_checkpoint(final):   # another process converted it meanwhile
            return final
        for old in glob.glob(os.path.join(root, f".{name}.tmp-*")):   # a killed conversion's
            shutil.rmtree(old, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
        try:
            if note:
                log(f"photon_jax: {note}")
            log(f"photon_jax: converting {snapshot} ({dt}) into {final}; later loads reuse it")
            t0 = time.perf_counter()
            _convert(snapshot, os.path.join(tmp, "ckpt"), dtype=dt, tokenizer=tokenizer,
                     log=lambda s: None)
            try:
                os.rename(os.path.join(tmp, "ckpt"), final)
            except OSError:
                if not is_photon_checkpoint(final):   # (else: another process won the race)
                    raise
            log(f"photon_jax: converted in {time.perf_counter() - t0:.1f} s")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final

"""What a CPU device can allocate: the host memory the kernel can give this process.

Not Linux's free pages (SC_AVPHYS_PAGES): those leave out the page cache, which the kernel
drops on demand, so right after photon-convert writes a checkpoint "free" is near zero while
most of the memory is available.  We count `MemAvailable` (the kernel's own estimate of what
it can give without swapping: free pages plus the reclaimable cache and slabs) and, inside a
container, the headroom under the cgroup's limit (v2 or v1, the process's cgroup and its
ancestors), since exceeding that gets the process OOM-killed whatever the host has.  Where
neither can be read, the free pages.  `memory.device_free` asks here for host platforms.

And the other host limit a CPU process meets: its memory mappings (`mapping_headroom`).
XLA:CPU keeps each compiled program's machine code in mappings of its own (about 3 per
object file, up to `--xla_cpu_parallel_codegen_split_count` object files per program), so
a process that compiles thousands of programs can reach Linux's `vm.max_map_count` (65,530
by default).  There XLA's compiles fail ("LLVM compilation error: Cannot allocate memory"),
and the failed ones leave their exception-unwinding tables registered over memory already
unmapped, so the process's next C++ exception, anywhere, dies in libgcc's unwinder
(docs/testing.md, "The worker crashes").  The engine warns before that.
"""

from __future__ import annotations

import os


# cgroup v1 writes "no limit" as the page counter's maximum (9223372036854771712 with 4 KiB
# pages, other values with other page sizes): any limit this large is none.
CGROUP_NO_LIMIT = 1 << 60


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def meminfo_available(text: str) -> int | None:
    """`MemAvailable` of a /proc/meminfo text, in bytes (None: absent; kernels before 3.14)."""
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            try:
                return int(fields[1]) * (1024 if fields[2:3] == ["kB"] else 1)
            except (IndexError, ValueError):
                return None
    return None


def stat_field(text: str, name: str) -> int | None:
    """One `name value` line of a cgroup memory.stat text."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def cgroup_paths(text: str) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 memory controller's path) of a /proc/self/cgroup text: lines
    `id:controllers:path`, v2's with id 0 and no controllers."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def cgroup_dirs(root: str, path: str) -> list[str]:
    """The cgroup's folder under `root` and each ancestor's, leaf first.  A limit set on an
    ancestor (a pod's, a systemd slice's) binds the leaf as well; and inside a container
    without its own cgroup namespace the path names the host's hierarchy while `root` is the
    container's own cgroup, so only the shorter prefixes exist there."""
    parts = [p for p in path.strip().split("/") if p]
    return [os.path.join(root, *parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_headroom(limit: int | None, usage: int | None, inactive_file: int | None) -> int | None:
    """Bytes the cgroup can still charge before its limit (None: no limit, or unreadable).
    The usage counts the cgroup's page cache, which the kernel reclaims before it OOM-kills;
    like `docker stats` and the kubelet's working set, we take out the inactive file pages
    (the cache it reclaims first) and keep the active ones, which errs low."""
    if limit is None or usage is None or limit >= CGROUP_NO_LIMIT:
        return None
    return max(0, limit - max(0, usage - (inactive_file or 0)))


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if text == "max":   # cgroup v2: no limit
        return CGROUP_NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def cgroup_v2_headroom(folder: str) -> int | None:
    """memory.max - (memory.current - inactive_file) of one v2 cgroup (its memory.stat is
    hierarchical: it counts the descendants' pages, as memory.current does)."""
    stat = _read(os.path.join(folder, "memory.stat")) or ""
    return cgroup_headroom(_int(_read(os.path.join(folder, "memory.max"))),
                           _int(_read(os.path.join(folder, "memory.current"))),
                           stat_field(stat, "inactive_file"))


def cgroup_v1_headroom(folder: str) -> int | None:
    """memory.limit_in_bytes - (memory.usage_in_bytes - total_inactive_file) of one v1
    cgroup (the usage is hierarchical, and `total_` is memory.stat's hierarchical count;
    `inactive_file` alone is this cgroup's own pages)."""
    stat = _read(os.path.join(folder, "memory.stat")) or ""
    inactive = stat_field(stat, "total_inactive_file")
    return cgroup_headroom(_int(_read(os.path.join(folder, "memory.limit_in_bytes"))),
                           _int(_read(os.path.join(folder, "memory.usage_in_bytes"))),
                           stat_field(stat, "inactive_file") if inactive is None else inactive)


def cgroup_available(cgroup_root: str = "/sys/fs/cgroup",
                     self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The least headroom over the process's memory cgroup and its ancestors, v2 (mounted at
    `cgroup_root`) or v1 (`cgroup_root`/memory); None: no limit set or nothing readable."""
    v2, v1 = cgroup_paths(_read(self_cgroup) or "")
    rooms = []
    if v2 is not None:
        rooms += [cgroup_v2_headroom(d) for d in cgroup_dirs(cgroup_root, v2)]
    if v1 is not None:
        rooms += [cgroup_v1_headroom(d)
                  for d in cgroup_dirs(os.path.join(cgroup_root, "memory"), v1)]
    rooms = [r for r in rooms if r is not None]
    return min(rooms) if rooms else None


def free_pages() -> int | None:
    """Linux's free pages in bytes (no page cache): the last resort where neither
    /proc/meminfo nor a cgroup can be read."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def host_available(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                   self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes of host memory the process can still allocate: the smaller of MemAvailable and
    the cgroup's headroom, whichever can be read; neither: the free pages (None: not even
    those)."""
    known = [v for v in (meminfo_available(_read(meminfo) or ""),
                         cgroup_available(cgroup_root, self_cgroup)) if v is not None]
    return min(known) if known else free_pages()


# Warn when a process's memory mappings pass this share of `vm.max_map_count`.
MAPPINGS_WARN_SHARE = 0.8


def mappings_in_use(maps: str = "/proc/self/maps") -> int | None:
    """How many memory mappings this process holds (None: not Linux)."""
    try:
        with open(maps, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def max_mappings(path: str = "/proc/sys/vm/max_map_count") -> int | None:
    """Linux's per-process mapping limit, `vm.max_map_count` (None: unknown)."""
    return _int(_read(path))


def mapping_headroom(maps: str = "/proc/self/maps",
                     limit_path: str = "/proc/sys/vm/max_map_count") -> tuple[int, int] | None:
    """(mappings in use, the limit), or None where either cannot be read."""
    used, limit = mappings_in_use(maps), max_mappings(limit_path)
    return None if used is None or not limit else (used, limit)


def mappings_warning(maps: str = "/proc/self/maps",
                     limit_path: str = "/proc/sys/vm/max_map_count") -> str | None:
    """A warning naming the fix when this process holds more than `MAPPINGS_WARN_SHARE` of
    its mapping limit, else None."""
    room = mapping_headroom(maps, limit_path)
    if room is None or room[0] <= MAPPINGS_WARN_SHARE * room[1]:
        return None
    used, limit = room
    return (f"this process holds {used} memory mappings of the {limit} Linux allows it "
            f"(vm.max_map_count); XLA:CPU keeps every compiled program's code in mappings of "
            f"its own, and at the limit its compiles fail and the process can crash. Compile "
            f"fewer programs in one process (fewer engines, configs or shape buckets), set "
            f"XLA_FLAGS=--xla_cpu_parallel_codegen_split_count=1 (fewer mappings per "
            f"program), or raise the limit (sysctl -w vm.max_map_count=262144).")


_warned_mappings = False


def warn_mappings(log) -> bool:
    """Log `mappings_warning` once per process (engines call it after compiling); True if
    it logged now."""
    global _warned_mappings
    if _warned_mappings:
        return False
    msg = mappings_warning()
    if msg is None:
        return False
    _warned_mappings = True
    log.warning("photon_jax: %s", msg)
    return True

"""What the CPU device reports free (`memory.device_free` -> `hostmem.host_available`): the
kernel's MemAvailable, page cache included, within the cgroup's limit; Linux's free pages only
where neither can be read.  Before, it was the free pages alone, which fall to near zero once
photon-convert has written a checkpoint into the page cache, and a full-size model was refused
with "device free 0.22 GiB" on a host with 22 GiB available."""

import functools
import os

import jax
import pytest

from photon_jax.engine import hostmem, memory

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
MEMINFO = "/proc/meminfo"


def meminfo_text(available_kib: int, free_kib: int = 1024) -> str:
    return (f"MemTotal:       {4 * available_kib} kB\n"
            f"MemFree:        {free_kib} kB\n"
            f"MemAvailable:   {available_kib} kB\n"
            "Buffers:           1000 kB\n"
            f"Cached:         {available_kib - free_kib} kB\n")


def write(path, text: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def v2_cgroup(folder, limit: str, current: int, inactive_file: int) -> None:
    write(folder / "memory.max", f"{limit}\n")
    write(folder / "memory.current", f"{current}\n")
    write(folder / "memory.stat", f"anon {current - inactive_file}\nfile {inactive_file}\n"
                                  f"active_file 0\ninactive_file {inactive_file}\n")


def v1_cgroup(folder, limit: int, usage: int, inactive_file: int) -> None:
    write(folder / "memory.limit_in_bytes", f"{limit}\n")
    write(folder / "memory.usage_in_bytes", f"{usage}\n")
    # `inactive_file` is the cgroup's own pages, `total_inactive_file` its subtree's: the
    # usage is the subtree's, so the rule takes the total (own pages set apart to tell).
    write(folder / "memory.stat", f"cache {inactive_file}\ninactive_file 4096\n"
                                  f"total_inactive_file {inactive_file}\n")


@pytest.fixture
def fake(tmp_path):
    """A fake /proc/meminfo with 8 GiB available, a cgroup root and a /proc/self/cgroup."""
    meminfo = write(tmp_path / "meminfo", meminfo_text(8 * GiB // KiB))
    root = tmp_path / "cgroup"
    root.mkdir()

    def available(self_cgroup: str, meminfo=meminfo):
        return hostmem.host_available(meminfo=meminfo, cgroup_root=str(root),
                                     self_cgroup=write(tmp_path / "self_cgroup", self_cgroup))
    available.root = root
    return available


# -- the real host ----------------------------------------------------------------------------

def read_available() -> int:
    """MemAvailable, read here, independently of the module."""
    with open(MEMINFO) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    pytest.skip("this kernel's /proc/meminfo has no MemAvailable (before Linux 3.14)")


@pytest.mark.skipif(not os.path.exists(MEMINFO), reason="no /proc/meminfo (not Linux)")
def test_the_cpu_counts_the_page_cache_as_available(tmp_path):
    """A checkpoint just written and read is in the page cache: the free pages leave it out,
    MemAvailable and the CPU device's free memory count it."""
    cpu = jax.devices("cpu")[0]
    tol = 64 * MiB
    path = tmp_path / "checkpoint.bin"
    chunk = os.urandom(16 * MiB)
    try:
        with open(path, "wb") as f:
            for _ in range(32):   # 512 MiB
                f.write(chunk)
        with open(path, "rb") as f:
            while f.read(16 * MiB):
                pass
        for _ in range(5):   # other processes allocate meanwhile: retry until it is quiet
            before = read_available()
            got = memory.device_free(cpu)
            after = read_available()
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            if abs(after - before) <= tol:
                break
        if min(before, after) - pages < 4 * tol:
            pytest.skip("the file's pages are not in the page cache (tmpfs, or memory "
                        "pressure evicted them): nothing tells the two counts apart")
        limit = hostmem.cgroup_available()
        if limit is not None and limit < before - tol:
            # A container: its limit binds, not the host's memory.
            assert got <= max(before, after) + tol
            assert abs(got - limit) <= tol
            return
        assert min(before, after) - tol <= got <= max(before, after) + tol, \
            (got / GiB, before / GiB, pages / GiB)
        # The old count (the free pages) is more than `tol` short of it.
        assert got >= pages + 2 * tol
    finally:
        path.unlink(missing_ok=True)


# -- fake files -------------------------------------------------------------------------------

def test_cgroup_v2_limit_below_memavailable_is_honoured(fake):
    """2 GiB limit, 1.5 GiB charged of which 0.5 GiB inactive cache: 1 GiB of headroom
    (not 0.5: the cache goes first), below the host's 8 GiB."""
    v2_cgroup(fake.root / "pod" / "app", "2147483648", 1536 * MiB, 512 * MiB)
    assert fake("0::/pod/app\n") == 1 * GiB


def test_cgroup_v2_without_a_limit_gives_memavailable(fake):
    v2_cgroup(fake.root / "app", "max", 1536 * MiB, 512 * MiB)
    assert fake("0::/app\n") == 8 * GiB


def test_cgroup_v2_limit_above_memavailable_gives_memavailable(fake):
    v2_cgroup(fake.root / "app", str(64 * GiB), 1 * GiB, 0)
    assert fake("0::/app\n") == 8 * GiB


def test_an_ancestors_limit_binds(fake):
    """A pod's limit binds its containers, which set none of their own."""
    v2_cgroup(fake.root / "pod", str(3 * GiB), 2 * GiB, 0)
    v2_cgroup(fake.root / "pod" / "app", "max", 1 * GiB, 0)
    assert fake("0::/pod/app\n") == 1 * GiB


def test_cgroup_v1_limit_is_honoured(fake):
    """Hybrid layout (v1 memory controller, an empty v2 line): limit - (usage - the
    subtree's inactive file pages)."""
    v1_cgroup(fake.root / "memory" / "docker" / "abc", 3 * GiB, 2 * GiB, 512 * MiB)
    assert fake("9:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n") == 1536 * MiB


def test_cgroup_v1_without_a_limit_gives_memavailable(fake):
    v1_cgroup(fake.root / "memory" / "docker" / "abc", 9223372036854771712, 2 * GiB, 0)
    assert fake("4:memory:/docker/abc\n") == 8 * GiB


def test_cgroup_v1_mounted_at_the_containers_own_cgroup(fake):
    """Without a cgroup namespace the path names the host's hierarchy, but the container sees
    its own cgroup at the mount's root."""
    v1_cgroup(fake.root / "memory", 2 * GiB, 1 * GiB, 0)
    assert fake("4:cpu,memory:/docker/abc\n") == 1 * GiB


def test_cgroup_over_its_limit_has_no_room(fake):
    v2_cgroup(fake.root / "app", str(1 * GiB), 2 * GiB, 0)
    assert fake("0::/app\n") == 0


def test_cgroup_alone_where_meminfo_is_unreadable(fake, tmp_path):
    v2_cgroup(fake.root / "app", str(2 * GiB), 1 * GiB, 0)
    assert fake("0::/app\n", meminfo=str(tmp_path / "missing")) == 1 * GiB


def test_meminfo_alone_where_no_cgroup_is_readable(fake, tmp_path):
    (fake.root / "app").mkdir()
    write(fake.root / "app" / "memory.max", "garbage\n")
    assert fake("0::/app\n") == 8 * GiB
    assert hostmem.host_available(meminfo=write(tmp_path / "m", meminfo_text(1234)),
                                 cgroup_root=str(tmp_path / "none"),
                                 self_cgroup=str(tmp_path / "none")) == 1234 * KiB


@pytest.mark.parametrize("meminfo", ["missing", "a folder", "no MemAvailable line"])
def test_free_pages_where_nothing_else_can_be_read(tmp_path, monkeypatch, meminfo):
    conf = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(hostmem.os, "sysconf", lambda name: conf[name])
    path = {"missing": str(tmp_path / "missing"),
            "a folder": str(tmp_path),
            "no MemAvailable line": write(tmp_path / "m", "MemTotal: 1 kB\nMemFree: 2 kB\n"),
            }[meminfo]
    assert hostmem.host_available(meminfo=path, cgroup_root=str(tmp_path / "none"),
                                 self_cgroup=str(tmp_path / "none")) == 1000 * 4096


def test_nothing_readable_at_all_is_unknown(tmp_path, monkeypatch):
    def no_sysconf(name):
        raise ValueError(name)
    monkeypatch.setattr(hostmem.os, "sysconf", no_sysconf)
    assert hostmem.host_available(meminfo=str(tmp_path / "x"), cgroup_root=str(tmp_path),
                                 self_cgroup=str(tmp_path / "x")) is None


def test_the_cpu_device_reports_host_available(fake, monkeypatch):
    """device_free of the CPU device is `host_available` (here: the fake cgroup's headroom,
    which the free pages could not be)."""
    v2_cgroup(fake.root / "app", str(2 * GiB), 1 * GiB, 0)
    self_cgroup = write(fake.root.parent / "self_cgroup", "0::/app\n")
    monkeypatch.setattr(memory, "host_available", functools.partial(
        memory.host_available, meminfo=str(fake.root.parent / "meminfo"),
        cgroup_root=str(fake.root), self_cgroup=self_cgroup))
    assert memory.device_free(jax.devices("cpu")[0]) == 1 * GiB


# -- parsing ----------------------------------------------------------------------------------

def test_parsers():
    assert hostmem.meminfo_available(meminfo_text(100)) == 100 * KiB
    assert hostmem.meminfo_available("MemTotal: 5 kB\n") is None
    assert hostmem.cgroup_paths("12:memory:/a/b\n0::/c\n") == ("/c", "/a/b")
    assert hostmem.cgroup_paths("1:name=systemd:/\n") == (None, None)
    assert hostmem.cgroup_dirs("/r", "/a/b") == ["/r/a/b", "/r/a", "/r"]
    assert hostmem.cgroup_dirs("/r", "/") == ["/r"]
    assert hostmem.stat_field("file 3\ninactive_file 7\n", "inactive_file") == 7
    assert hostmem.stat_field("total_inactive_file 7\n", "inactive_file") is None
    assert hostmem.cgroup_headroom(10, 8, 3) == 5
    assert hostmem.cgroup_headroom(None, 8, 3) is None
    assert hostmem.cgroup_headroom(hostmem.CGROUP_NO_LIMIT, 8, 3) is None

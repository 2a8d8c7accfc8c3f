"""How the code sandbox's harness confines itself (standard library only; copied next to the harness).

:func:`isolate` puts the calling process (the harness) in new PID, mount, IPC, network and UTS
namespaces and an empty root file system, and takes away every privilege it had:

- **as root**: the namespaces are made directly; the harness joins a memory cgroup of its own
  where the kernel offers one (:func:`join_memory_cgroup`), builds the new root, then switches to
  a uid of its own (``UID_BASE + pid``, no groups), which clears every capability;
- **as another user**: a user namespace first (the user's uid is uid 1000 inside, and the only
  one), which grants the capabilities needed to build the root inside it and nowhere else; after
  building it, the capability sets (bounding, ambient, permitted, effective) are emptied.

The new root is a read-only tmpfs holding only: the interpreter's directories (``sys.prefix``, the
base prefix, the executable's directory) and the system library directories (``/lib*``,
``/usr/lib*``, ``/etc/ld.so.cache``), bound read-only (their sub-mounts too); ``/dev/null``,
``zero``, ``full``, ``random``, ``urandom``; a private ``/dev/shm`` tmpfs; and ``/tmp``, the program's
scratch directory, a private tmpfs of ``file_size_mb`` (an interpreter that lives under ``/tmp``, such
as a CI job's virtualenv, is bound read-only at its path inside it: the program sees that directory
there and cannot remove it). There is no ``/proc``, no ``/sys``, no home
directory, no data file and no other process: the PID namespace holds only the sandbox's own
processes, and the network namespace only a loopback interface that is down.
"""

import ctypes
import errno
import os

UID_BASE = 0x40000000  # root mode: sandbox uid = UID_BASE + harness pid, unique while it lives
INNER_ID = 1000  # user-namespace mode: the program's uid and gid as it sees them
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    1024,
    2048,
    4096,
    16384,
    1 << 18,
    1 << 21,
)
MNT_DETACH, MS_STRICTATIME = 2, 1 << 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, PR_SET_DUMPABLE = 24, 47, 4, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
LIBRARY_DIRS = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32")
DEVICES = ("null", "zero", "full", "random", "urandom")
SHM_BYTES = 16 << 20
# statvfs flag -> the mount flag that keeps it on a read-only remount (a locked flag cannot be cleared).
KEEP_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME),
)  # fmt: skip


def libc():
    return ctypes.CDLL(None, use_errno=True)


def call(fn, *args, what):
    """Call a libc function with unsigned-long-sized integer arguments; raise OSError on -1."""
    args = [ctypes.c_ulong(a) if isinstance(a, int) else a for a in args]
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(lib, source, target, fstype, flags, data=None):
    enc = [s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data)]
    call(lib.mount, enc[0], enc[1], enc[2], flags, enc[3], what=f"mount {target}")


def isolate(lib, job):
    """Enter the namespaces and the new root (see the module docs).

    Returns ``(protections, cgroup)``: the names of what is in force, and the memory cgroup's
    directory (for the parent to remove) or None. Raises ``OSError`` with the system's reason when
    the kernel refuses any step. Afterwards this process's next child is PID 1 of the sandbox.
    """
    expose = sorted(set(job["expose"]))
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET | CLONE_NEWUTS
    protections = ["pid_namespace", "mount_namespace", "ipc_namespace", "network_namespace", "uts_namespace"]
    cgroup = None
    if os.geteuid() == 0:
        uid = UID_BASE + os.getpid()
        cgroup = join_memory_cgroup(job["cgroup_bytes"])
        call(lib.unshare, flags, what="unshare(pid, mount, ipc, network, uts namespaces)")
        build_root(lib, expose, job["file_bytes"], uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # from root to another uid: every capability is cleared
        protections.append("unprivileged_uid")
    else:
        uid, gid = os.getuid(), os.getgid()
        call(
            lib.unshare, CLONE_NEWUSER | flags, what="unshare(user, pid, mount, ipc, network, uts namespaces)"
        )
        maps = (("setgroups", "deny"), ("uid_map", f"{INNER_ID} {uid} 1"), ("gid_map", f"{INNER_ID} {gid} 1"))
        for name, text in maps:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        build_root(lib, expose, job["file_bytes"], INNER_ID)
        drop_capabilities(lib)
        protections.append("user_namespace")
    if any(capabilities(lib)):
        raise OSError("the sandbox still holds capabilities after dropping them")
    protections += ["read_only_root", "private_tmp", "private_dev_shm", "no_capabilities"]
    if cgroup:
        protections.append("cgroup_memory")
    return protections, cgroup


def build_root(lib, expose, scratch_bytes, owner):
    """Build the new root in ``./root`` (see the module docs) and make it this process's ``/``."""
    mount(lib, "none", "/", None, MS_REC | MS_PRIVATE)
    root = os.path.abspath("root")
    os.mkdir(root, 0o755)
    mount(lib, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    os.mkdir(f"{root}/tmp")
    opts = f"size={scratch_bytes},nr_inodes=1024,mode=0700,uid={owner},gid={owner}"
    mount(lib, "tmpfs", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    os.makedirs(f"{root}/dev/shm")
    mount(
        lib,
        "tmpfs",
        f"{root}/dev/shm",
        "tmpfs",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        f"size={SHM_BYTES},mode=1777",
    )
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{root}/dev/{name}", "w").close()
            mount(lib, f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    needed = [p for p in LIBRARY_DIRS if os.path.lexists(p)] + ["/etc/ld.so.cache", *expose]
    needed = sorted({p if os.path.islink(p) else os.path.realpath(p) for p in needed if os.path.lexists(p)})
    for path in needed:
        if any(path.startswith(other + "/") for other in needed if not os.path.islink(other)):
            continue  # inside another exposed directory
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems
            os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            open(target, "w").close()
        mount(lib, path, target, None, MS_BIND | MS_REC)
        for point in mounts_under(target):
            mount(lib, "none", point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept_flags(point))
    mount(lib, "none", root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"the sandbox knows pivot_root on x86_64 and aarch64, not {machine}")
    if lib.syscall(ctypes.c_long(SYS_PIVOT_ROOT[machine]), b".", b".") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    call(lib.umount2, b".", MNT_DETACH, what="umount the old root")
    os.chdir("/")


def mounts_under(target):
    """Mount points at or below ``target``, from /proc/self/mountinfo (octal escapes decoded)."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = line.split()[4].decode("unicode_escape").encode("latin-1").decode()
            if point == target or point.startswith(target + "/"):
                points.append(point)
    return points


def kept_flags(point):
    """The flags a read-only remount of ``point`` must repeat (a user namespace cannot clear them)."""
    have = os.statvfs(point).f_flag
    flags = 0
    for st, ms in KEEP_FLAGS:
        if have & st:
            flags |= ms
    if not have & (os.ST_NOATIME | os.ST_RELATIME):
        flags |= MS_STRICTATIME
    return flags


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def capabilities(lib):
    """This process's (effective, permitted, inheritable) capability masks, 64 bits each."""
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    call(lib.capget, ctypes.byref(header), data, what="capget")
    return tuple(
        getattr(data[0], f) | getattr(data[1], f) << 32 for f in ("effective", "permitted", "inheritable")
    )


def drop_capabilities(lib):
    """Empty the bounding, ambient, permitted, effective and inheritable capability sets."""
    for cap in range(64):  # until EINVAL: past the kernel's last capability (no /proc to ask here)
        if lib.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL and cap > 0:
                break
            raise OSError(ctypes.get_errno(), f"drop capability {cap}: {os.strerror(ctypes.get_errno())}")
    call(lib.prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, what="clear ambient capabilities")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    call(lib.capset, ctypes.byref(header), (_CapData * 2)(), what="capset")


def join_memory_cgroup(limit_bytes):
    """Move this process into a new memory cgroup capped at ``limit_bytes`` (its children follow).

    Best effort, root only: cgroup v1's memory controller, or v2 where this process's cgroup lets
    children use the memory controller. Returns the cgroup's directory, or None where neither is
    available (the per-process address-space limit still holds).
    """
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    candidates = []
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            candidates.append(
                (f"/sys/fs/cgroup/memory{path}", ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
            )
        elif controllers == "":
            base = f"/sys/fs/cgroup{path}".rstrip("/")
            try:
                with open(f"{base}/cgroup.subtree_control") as f:
                    if "memory" in f.read().split():
                        candidates.append((base, ("memory.max", "memory.swap.max")))
            except OSError:
                pass
    for base, (limit_file, swap_file) in candidates:
        group = f"{base.rstrip('/')}/tearless-sandbox-{os.getpid()}"
        try:
            os.mkdir(group)
        except OSError:
            continue
        try:
            with open(f"{group}/{limit_file}", "w") as f:
                f.write(str(limit_bytes))
            if os.path.exists(f"{group}/{swap_file}"):
                with open(f"{group}/{swap_file}", "w") as f:
                    f.write("0" if swap_file == "memory.swap.max" else str(limit_bytes))
            with open(f"{group}/cgroup.procs", "w") as f:
                f.write("0")
            return group
        except OSError:
            try:
                os.rmdir(group)
            except OSError:
                pass
    return None

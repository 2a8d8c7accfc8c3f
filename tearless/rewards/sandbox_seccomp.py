"""The code sandbox's system-call filter: a seccomp-BPF program built here, in the standard library.

Copied next to the harness and imported by it (standard library only, like the harness). Why not a
binding: the seccomp-BPF program format and ``prctl(PR_SET_SECCOMP)`` are a stable kernel ABI, and
a deny list is a short straight-line program; the Python bindings on PyPI (``pyseccomp``, last
released 2021; libseccomp's own ``seccomp`` bindings, built from source) load the C library
``libseccomp.so``, which pip cannot install, so they would add a failure mode (and a dependency)
without adding strength. The syscall numbers below were taken from the kernel's
``asm/unistd_64.h`` (x86-64) and ``asm-generic/unistd.h`` (aarch64); other architectures are refused.

What the filter does, in order:

1. a system call made through another ABI than the native one (i386 ``int 0x80`` on x86-64, the x32
   ABI) fails with EPERM: its numbers mean other calls, and a deny list would not see them;
2. ``clone`` with any namespace flag fails with EPERM (plain ``fork`` and threads pass);
   ``clone3``, whose flags sit in memory a filter cannot read, fails with ENOSYS, so the C
   library falls back to ``clone`` (what container runtimes do);
3. every call in :data:`DENIED` fails with EPERM: new namespaces and joining others, mounts and
   root changes, tracing and reading or writing other processes' memory, signalling through
   pidfds, kernel keyrings, BPF, perf, userfaultfd, io_uring, modules, kexec, reboot, swap, clocks,
   the kernel log, process accounting, quotas, file handles, raw port I/O and personality changes;
4. everything else is allowed (the namespaces, the uid and the rlimits bound it).
"""

import ctypes
import errno
import platform
import struct

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
# Classic BPF opcodes (linux/filter.h): load a 32-bit word of seccomp_data, compare, return.
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
# Offsets in struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}; args[0]'s low word
# (little-endian) holds clone's flags.
NR_OFFSET, ARCH_OFFSET, ARG0_LOW_OFFSET = 0, 4, 16
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME.
CLONE_NAMESPACE_FLAGS = (
    0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
)
X32_SYSCALL_BIT = 0x40000000

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "move_pages", "migrate_pages",
    "process_madvise", "process_mrelease", "pidfd_send_signal", "pidfd_getfd",
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "syslog", "acct", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "quotactl",
    "quotactl_fd", "personality", "sethostname", "setdomainname", "vhangup", "lookup_dcookie",
    "uselib", "nfsservctl",
)  # fmt: skip

# (AUDIT_ARCH_*, {name: number}); a name missing from an architecture's table does not exist there.
ARCHES = {
    "x86_64": (0xC000003E, {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "move_pages": 279, "migrate_pages": 256, "process_madvise": 440, "process_mrelease": 448,
        "pidfd_send_signal": 424, "pidfd_getfd": 438, "unshare": 272, "setns": 308, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "syslog": 103,
        "acct": 163, "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305,
        "adjtimex": 159, "open_by_handle_at": 304, "name_to_handle_at": 303, "iopl": 172,
        "ioperm": 173, "quotactl": 179, "quotactl_fd": 443, "personality": 135,
        "sethostname": 170, "setdomainname": 171, "vhangup": 153, "lookup_dcookie": 212,
        "uselib": 134, "nfsservctl": 180, "clone": 56, "clone3": 435,
    }),
    "aarch64": (0xC00000B7, {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "move_pages": 239, "migrate_pages": 238, "process_madvise": 440, "process_mrelease": 448,
        "pidfd_send_signal": 424, "pidfd_getfd": 438, "unshare": 97, "setns": 268, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "syslog": 116,
        "acct": 89, "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266,
        "adjtimex": 171, "quotactl": 60, "quotactl_fd": 443, "personality": 92,
        "sethostname": 161, "setdomainname": 162, "vhangup": 58, "lookup_dcookie": 18,
        "nfsservctl": 42, "clone": 220, "clone3": 435,
    }),
}  # fmt: skip


def _insn(code, jt, jf, k):
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(machine=None):
    """The filter program for ``machine`` (``platform.machine()`` by default) as raw bytes, 8 per
    instruction. Raises ``OSError`` for an architecture without a table."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise OSError(f"the sandbox's syscall filter knows x86_64 and aarch64, not {machine}")
    arch, numbers = ARCHES[machine]
    denied = [numbers[name] for name in DENIED if name in numbers]
    # Layout: [0] load arch, [1] foreign arch -> EPERM, [2] load nr, ([3] x32 -> EPERM), one jeq per
    # denied number, clone3 -> ENOSYS, clone -> flag check, ALLOW; flag check: load flags,
    # namespace bit -> EPERM, ALLOW; then the two return instructions.
    body = []  # (code, jump target name or None, k); targets resolved once the length is known
    body.append((BPF_LD_W_ABS, None, ARCH_OFFSET))
    body.append((BPF_JEQ_K, ("next", "eperm"), arch))
    body.append((BPF_LD_W_ABS, None, NR_OFFSET))
    if machine == "x86_64":
        body.append((BPF_JGE_K, ("eperm", "next"), X32_SYSCALL_BIT))
    body += [(BPF_JEQ_K, ("eperm", "next"), nr) for nr in denied]
    body.append((BPF_JEQ_K, ("enosys", "next"), numbers["clone3"]))
    body.append((BPF_JEQ_K, ("clone", "next"), numbers["clone"]))
    body.append((BPF_RET_K, None, SECCOMP_RET_ALLOW))
    labels = {"clone": len(body)}
    body.append((BPF_LD_W_ABS, None, ARG0_LOW_OFFSET))
    body.append((BPF_JSET_K, ("eperm", "next"), CLONE_NAMESPACE_FLAGS))
    body.append((BPF_RET_K, None, SECCOMP_RET_ALLOW))
    labels["eperm"] = len(body)
    body.append((BPF_RET_K, None, SECCOMP_RET_ERRNO | errno.EPERM))
    labels["enosys"] = len(body)
    body.append((BPF_RET_K, None, SECCOMP_RET_ERRNO | errno.ENOSYS))
    program = []
    for pc, (code, targets, k) in enumerate(body):
        jumps = [0, 0]
        for j, target in enumerate(targets or ()):
            # A jump offset counts the instructions skipped after this one, at most 255.
            jumps[j] = 0 if target == "next" else labels[target] - pc - 1
            if not 0 <= jumps[j] <= 255:
                raise AssertionError(f"filter jump out of range at {pc}")
        program.append(_insn(code, jumps[0], jumps[1], k))
    return b"".join(program)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(lib, machine=None):
    """Set no-new-privileges and load the filter into this process; its children inherit it."""
    program = build_filter(machine)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    for args, what in (
        ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)"),
        ((PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)"),
    ):
        if lib.prctl(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {errno.errorcode.get(err, err)}")

"""Run a Python file as a fresh unprivileged user (a test helper; needs root to start).

``python as_user.py SCRIPT [ARGS…]``: enters a private mount namespace, makes the interpreter and
this checkout reachable if they live under a directory other users cannot enter (``/root/.pyenv``
here, or a clone and venv under a ``mktemp -d`` directory: that directory is covered with an empty
tmpfs and the needed directories bound back), switches to uid and
gid ``0x30000000 + pid`` with no groups, and runs SCRIPT as ``__main__``. What it shows is what a
user without root gets: the process has no capability and owns nothing on the host.
"""

import ctypes
import os
import sys

MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def expose_interpreter(lib) -> None:
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    needed = sorted(
        {
            os.path.realpath(p)
            for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), checkout)
        }
    )
    covers = set()
    for path in needed:
        parts = path.split("/")
        for depth in range(2, len(parts)):
            ancestor = "/".join(parts[:depth])
            if not os.stat(ancestor).st_mode & 0o001:
                covers.add(ancestor)
                break
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in needed}
    for cover in sorted(covers):
        _check(lib.mount(b"tmpfs", cover.encode(), b"tmpfs", 0, b"mode=0755"), f"tmpfs {cover}")
        for path, fd in handles.items():
            if path.startswith(cover + "/"):
                os.makedirs(path, exist_ok=True)
                _check(
                    lib.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None),
                    path,
                )


def main() -> None:
    with open(sys.argv[1]) as f:  # read while still root: the script may sit in a private directory
        code = compile(f.read(), sys.argv[1], "exec")
    lib = ctypes.CDLL(None, use_errno=True)
    _check(lib.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    _check(lib.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    expose_interpreter(lib)
    uid = 0x30000000 + os.getpid()
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    os.chdir("/tmp")
    sys.argv = sys.argv[1:]
    exec(code, {"__name__": "__main__", "__file__": sys.argv[0]})


if __name__ == "__main__":
    main()

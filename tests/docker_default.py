"""Run a command as inside a Docker container with the default seccomp profile and the
default capabilities, without a Docker engine (issue 12's third configuration).

    python -m tests.docker_default -- python -m pytest tests/test_sandbox.py -k "not e2e"

What Docker's default profile refuses to a container without ``CAP_SYS_ADMIN`` and the
other non-default capabilities, as a filter (``EPERM``; ``clone3``: ``ENOSYS`` so that
glibc falls back to ``clone``): namespaces (``unshare``, ``setns``, ``clone`` with a
``CLONE_NEW*`` flag), every ``mount`` call and the new mount API, ``bpf``,
``perf_event_open``, ``keyctl``/``add_key``/``request_key``, ``io_uring``,
``userfaultfd``, ``open_by_handle_at``, modules, ``kexec``, ``reboot``, ``acct``,
``swapon``, ``syslog``, ``quotactl``, clock and host-name setters, ``pidfd_getfd``,
``kcmp``, ``process_madvise``, and ``AF_VSOCK`` sockets. What stays allowed matters as much:
every other socket family (``AF_INET``, ``AF_NETLINK``, ``AF_PACKET``...), ``seccomp``, ``prctl``,
``landlock_*``, ``pidfd_open``, ``ptrace`` (kernel >= 4.8), ``setuid`` & co. Then the
capability bounding set is cut to Docker's default set, so the command (run as root)
keeps only those, like a container's root.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys

import pyseccomp as sc

DOCKER_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31}  # chown .. setfcap: Docker's defaults
CAP_LAST = 40
REFUSED = (
    "unshare", "setns", "mount", "umount2", "fsopen", "fsmount", "fsconfig", "fspick", "move_mount",
    "open_tree", "mount_setattr", "pivot_root", "bpf", "perf_event_open", "keyctl", "add_key",
    "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd",
    "open_by_handle_at", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "acct", "swapon", "swapoff", "syslog", "quotactl", "quotactl_fd", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "pidfd_getfd", "kcmp",
    "process_madvise", "lookup_dcookie", "fanotify_init", "vhangup", "iopl", "ioperm", "nfsservctl",
    "get_mempolicy", "set_mempolicy", "mbind", "move_pages", "name_to_handle_at",
)  # fmt: skip
CLONE_NEW = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
AF_VSOCK = 40  # the one family Docker's profile refuses


def docker_default_filter() -> sc.SyscallFilter:
    f = sc.SyscallFilter(sc.ALLOW)
    for name in REFUSED:
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # not a syscall on this arch
            f.add_rule(sc.ERRNO(errno.EPERM), name)
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for bit in (b for b in range(32) if CLONE_NEW & (1 << b)):
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
    f.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.EQ, AF_VSOCK))
    return f


def confine() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if not _has_cap(21):  # no CAP_SYS_ADMIN (CI inside a container): a filter needs no_new_privs
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    docker_default_filter().load()
    for cap in range(CAP_LAST + 1):
        if cap not in DOCKER_CAPS and libc.prctl(24, cap, 0, 0, 0) and ctypes.get_errno() != errno.EINVAL:
            raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")  # 24: PR_CAPBSET_DROP


def _has_cap(cap: int) -> bool:
    with open("/proc/self/status") as f:
        eff = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    return bool(int(eff, 16) >> cap & 1)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m tests.docker_default -- COMMAND [ARGS...]")
    confine()
    os.environ["TOOLOOP_TEST_DOCKER_DEFAULT"] = "1"
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()

"""Landlock and seccomp-bpf: two unprivileged kernel layers, applied by the call's own
process after ``no_new_privs`` and before the tool runs (fork and exec layers: in the
forked child, inherited over exec; bwrap: by the runner inside bubblewrap, whose own
mounts Landlock would refuse). Neither needs root or namespaces, and both work inside
Docker's default seccomp profile.

- **Landlock** (ABI >= 1 for files, >= 4 for TCP, >= 6 for scopes): the whole file system
  read-only but the run's folder (and, under bwrap, its private /tmp) and a few devices
  (/dev/null...); for a call without a uid of its own (a worker that is not root), the
  folders of all runs (the sandbox root, ``TOOLOOP_SANDBOX_ALLOW``) not even readable,
  its own folder apart; TCP ``connect``/``bind`` refused without network; with network, TCP
  ``connect`` to the Redis and broker ports refused (a ruleset allowing every other port,
  built once per process: ~0.5 s); abstract unix sockets and signals scoped to the call.
- **seccomp** (a BPF program built by libseccomp through ``pyseccomp``, once per process,
  loaded with one ``prctl``): no ``AF_INET``/``AF_INET6``/``AF_PACKET``/``AF_NETLINK``
  sockets without network (``AF_PACKET`` never); no ``ptrace``, ``mount``, ``unshare``,
  ``setns``, namespaces through ``clone``, ``keyctl``, ``bpf``, ``io_uring`` (its socket
  operations would pass the ``socket`` rule), ``userfaultfd``, ``perf_event_open``,
  modules, kexec; no TCP Fast Open sends (a ``connect`` inside ``sendto``).

``_landlock_apply`` and ``_seccomp_load`` run in the sandbox: standard library only,
imports inside (the exec runner ships their source).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlparse

log = logging.getLogger(__name__)

# Landlock (include/uapi/linux/landlock.h); the syscalls have the same numbers on every arch.
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_WRITE_ALL = sum(1 << b for b in range(4, 13)) | FS_WRITE_FILE  # remove, make_*: ABI 1
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")

# seccomp: what no tool needs, whatever its policy (see the module docstring).
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "unshare", "setns",
    "pivot_root", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fsopen", "fsmount", "fsconfig", "fspick",
    "move_mount", "open_tree", "mount_setattr", "quotactl", "swapon", "swapoff", "reboot", "syslog",
    "acct", "personality",
)  # fmt: skip
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
_MSG_FASTOPEN = 0x20000000
_NO_NET_FAMILIES = (socket.AF_INET, socket.AF_INET6, socket.AF_PACKET, socket.AF_NETLINK)


@dataclass
class Confinement:
    """What the call's process applies to itself (picklable: it travels with the plan)."""

    landlock: dict | None = None  # for _landlock_apply; None: Landlock not available here
    bpf: bytes | None = None  # seccomp program; None: not available here
    net_fd: int | None = None  # a ruleset: TCP connect to every port but Redis's and the broker's
    missing: list[str] = field(default_factory=list)  # why a layer is off


# -- what this host offers -------------------------------------------------------------------
@lru_cache(maxsize=1)
def landlock_abi() -> tuple[int, str]:
    """(ABI version, why 0)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if version < 0:
        err = ctypes.get_errno()
        why = {errno.ENOSYS: "the kernel has no Landlock", errno.EOPNOTSUPP: "Landlock is disabled at boot",
               errno.EPERM: "refused (a seccomp profile?)"}.get(err, os.strerror(err))  # fmt: skip
        return 0, f"Landlock unavailable: {why}"
    return int(version), ""


@lru_cache(maxsize=2)
def seccomp_program(network: bool) -> tuple[bytes | None, str]:
    """The BPF program for a policy (built once per process), or why there is none."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as exc:  # RuntimeError: libseccomp.so missing
        return None, f"seccomp unavailable: pyseccomp/libseccomp: {exc}"
    try:
        f = sc.SyscallFilter(sc.ALLOW)
        for name in DENIED_SYSCALLS:
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # unknown on this arch
                f.add_rule(sc.ERRNO(errno.EPERM), name)
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags in a struct: glibc falls back to clone
        for bit in _bits(_CLONE_NEW):
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
        families = _NO_NET_FAMILIES if not network else (socket.AF_PACKET,)
        for family in families:
            f.add_rule(sc.ERRNO(errno.EACCES), "socket", sc.Arg(0, sc.EQ, family))
        for name, arg in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
            f.add_rule(sc.ERRNO(errno.EACCES), name, sc.Arg(arg, sc.MASKED_EQ, _MSG_FASTOPEN, _MSG_FASTOPEN))
        return _export(f), ""
    except Exception as exc:
        return None, f"seccomp unavailable: {type(exc).__name__}: {exc}"


def _bits(mask: int) -> list[int]:
    return [1 << b for b in range(32) if mask & (1 << b)]


def _export(f: object) -> bytes:
    import tempfile

    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)  # type: ignore[attr-defined]
        out.seek(0)
        return out.read()


def denied_ports() -> list[int]:
    """Ports of Redis and the broker: a call never connects to them, whatever its policy."""
    from orchestrator.settings import get_settings

    settings = get_settings()
    defaults = {"redis": 6379, "rediss": 6379, "amqp": 5672, "amqps": 5671, "pyamqp": 5672}
    ports = {6379, 5672, 5671}  # their default ports too: a second store or broker on this host
    for url in (settings.redis_url, settings.broker):
        for part in url.split(";"):  # kombu failover lists
            parsed = urlparse(part.strip())
            with contextlib.suppress(ValueError):
                port = parsed.port or defaults.get(parsed.scheme)
                if port:
                    ports.add(port)
    return sorted(ports)


_net_fds: dict[tuple[int, tuple[int, ...]], int] = {}  # (process, denied ports) -> ruleset


def net_ruleset(denied: list[int]) -> int:
    """A Landlock ruleset allowing TCP connect to every port but ``denied`` (kept open, once
    per process: Landlock has no deny rules, so this is 65 534 port rules, ~0.5 s)."""
    key = (os.getpid(), tuple(denied))
    if key in _net_fds:
        return _net_fds[key]
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    attr = ctypes.create_string_buffer(struct.pack("QQ", 0, NET_CONNECT_TCP), 16)
    fd = libc.syscall(_SYS_CREATE, attr, ctypes.c_size_t(16), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset (net)")
    rule = ctypes.create_string_buffer(16)
    skip = set(denied)
    for port in range(1 << 16):
        if port in skip:
            continue
        struct.pack_into("QQ", rule, 0, NET_CONNECT_TCP, port)
        if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(2), rule, ctypes.c_uint32(0)):
            err = ctypes.get_errno()
            os.close(fd)
            raise OSError(err, "landlock_add_rule (net port)")
    _net_fds[key] = int(fd)
    return int(fd)


def status() -> dict[str, str]:
    """For ``tooloop doctor`` and ``/api/health``: each layer's reason when it is off."""
    abi, why = landlock_abi()
    net = "" if abi >= 4 else (why or f"Landlock ABI {abi} < 4: no TCP rules")
    return {"landlock": why, "landlock_net": net, "seccomp": seccomp_program(False)[1]}


# -- what a call gets -------------------------------------------------------------------------
def confinement(workdir: str, network: bool, bwrap: bool, hidden: tuple[str, ...] = ()) -> Confinement:
    """The Landlock rules and seccomp program of one call (cheap: the costly parts are cached).
    ``hidden``: folders the call may not even read (the roots of all run folders), its own
    folder apart."""
    out = Confinement()
    abi, why = landlock_abi()
    if abi:
        writable = [workdir, "/tmp"] if bwrap else [workdir]  # bwrap's /tmp is its own tmpfs
        handled = FS_READ | FS_WRITE_ALL | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
        readable = readable_around(hidden) if hidden else ("/",)
        device = FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
        rules = [*((p, FS_READ) for p in readable), *((p, handled) for p in writable),
                 *((d, device) for d in DEVICES)]  # fmt: skip
        handled_net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 and not network else 0
        scoped = (SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL) if abi >= 6 else 0
        out.landlock = {"abi": abi, "handled_fs": handled, "handled_net": handled_net, "scoped": scoped,
                        "rules": rules}  # fmt: skip
        if network and abi >= 4:
            out.net_fd = net_ruleset(denied_ports())
    else:
        out.missing.append(why)
    out.bpf, why = seccomp_program(network)
    if why:
        out.missing.append(why)
    return out


MAX_BESIDE = 64  # entries of a folder on the way granted one by one; a larger folder stays closed


@lru_cache(maxsize=8)
def readable_around(hidden: tuple[str, ...]) -> tuple[str, ...]:
    """What a call may read when ``hidden`` folders must stay unreadable. Landlock has no
    deny rule: instead of ``/``, read access goes to each entry beside the way down to a
    hidden folder (``/usr``, ``/etc``...), and to where Python and the tool modules live.
    Closed: the folders on the way themselves (``ls /`` fails), entries made later (listed
    once per process), shared scratch folders (``/tmp``: sticky and world-writable, as
    bwrap's private one) and folders of more than MAX_BESIDE entries (a rule each costs
    a few microseconds in every call)."""
    from worker.sandbox.paths import _ancestors, _inside, _python_paths

    way = {a for h in hidden for a in _ancestors(h)}
    out = [p for p in _python_paths() if not any(_inside(h, p) for h in hidden)]
    for folder in sorted(f for f in way if not any(_inside(f, h) for h in hidden)):
        with contextlib.suppress(OSError):
            if os.stat(folder).st_mode & 0o1002 == 0o1002:
                continue  # /tmp, /var/tmp: anyone's files
            names = os.listdir(folder)
            if len(names) <= MAX_BESIDE:
                beside = (os.path.join(folder, n) for n in sorted(names))
                out += [p for p in beside if p not in way and _ruleable(p)]
    return tuple(dict.fromkeys(out))


def _ruleable(path: str) -> bool:
    """A folder or a regular file (what a Landlock rule may name), symlinks followed."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISDIR(mode) or stat.S_ISREG(mode)


# -- in the call's process (shipped to the exec runner: standard library only) --------------------
def _landlock_apply(spec: dict, net_fd: int | None) -> None:
    """Restrict this process (and what it starts) to ``spec``'s rules; then to ``net_fd``'s."""
    import ctypes
    import os
    import stat
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    size = 8 if spec["abi"] < 4 else 16 if spec["abi"] < 6 else 24
    fields = struct.pack("QQQ", spec["handled_fs"], spec["handled_net"], spec["scoped"])[:size]
    attr = ctypes.create_string_buffer(fields, size)
    fd = libc.syscall(444, attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    file_rights = 1 | 2 | 4 | (1 << 14) | (1 << 15)  # execute, write, read, truncate, ioctl_dev
    try:
        for path, access in spec["rules"]:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # (a device this host lacks)
            try:
                is_dir = stat.S_ISDIR(os.fstat(target).st_mode)
                allowed = access & spec["handled_fs"] & (~0 if is_dir else file_rights)
                rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, target), 12)
                if libc.syscall(445, ctypes.c_int(fd), ctypes.c_int(1), rule, ctypes.c_uint32(0)):
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(target)
        for ruleset in (fd, net_fd):
            if ruleset is not None and libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)):
                raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(fd)
        if net_fd is not None:
            os.close(net_fd)


def _seccomp_load(program: bytes) -> None:
    """Load a BPF program (no_new_privs is set already): every later syscall goes through it."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0):  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def apply(conf: Confinement) -> None:
    """In the call's process (fork and exec layers): Landlock, then seccomp."""
    if conf.landlock is not None:
        _landlock_apply(conf.landlock, conf.net_fd)
    if conf.bpf is not None:
        _seccomp_load(conf.bpf)

"""Kernel isolation a sandbox process applies to itself before it runs code it did not write.

`enter` puts the calling process in new mount, network, PID, IPC and UTS namespaces (and a user
namespace when not root), behind a private read-only root that holds only the system and Python
directories and the run's scratch directory, then sets rlimits and drops every capability (as
root, by becoming an unprivileged uid of its own). Children inherit all of it. Runs in the child
interpreter: standard library only.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from typing import List, Tuple

SANDBOX_UID_BASE = 200_000  # a run as root gets uid SANDBOX_UID_BASE + its first pid: unique among live runs
MAX_PROCESSES = 64  # RLIMIT_NPROC: processes and threads of the run's uid
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE, which also caps what stdout and stderr can hold
MAX_OPEN_FILES = 64
SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32")  # bound read-only into the new root
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
_MNT_DETACH = 2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_READ, _PR_CAPBSET_DROP = 1, 4, 23, 24
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)


class JailUnavailable(Exception):
    """The kernel refused a layer the sandbox needs (no user namespaces for a non-root caller, a
    seccomp policy that forbids unshare, ...)."""


def enter(scratch: str, writable: bool, memory_mb: int, cpu_s: int, allow_weak: bool) -> List[str]:
    """Isolate this process with `scratch` as its only visible directory of its own (writable or
    not); returns the layers that applied. Without namespaces, raises JailUnavailable unless
    `allow_weak`, in which case only rlimits and dropped privileges apply."""
    first_pid, root_caller = os.getpid(), os.geteuid() == 0
    namespaces = _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC | _CLONE_NEWUTS
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if root_caller and writable:
        os.chown(scratch, _run_uid(first_pid), _run_uid(first_pid))
    layers = []
    try:
        _unshare(namespaces | (0 if root_caller else _CLONE_NEWUSER))
    except JailUnavailable:
        if not allow_weak:
            raise
        if root_caller:
            _check_readable_by_all(os.path.realpath(sys.base_prefix))
    else:
        _become_namespace_init()
        _private_root(scratch, writable)
        layers.append("namespaces")
    os.chdir(scratch)
    _set_rlimits(memory_mb, cpu_s)
    layers.append("rlimits")
    layers.append(_drop_privileges(_run_uid(first_pid) if root_caller else None))
    return layers


def _check_readable_by_all(path: str) -> None:
    """Without a private root, a run's own uid reads the Python installation as any user would."""
    for directory in [path] + _ancestors(path):
        if os.stat(directory).st_mode & 0o005 != 0o005:
            raise JailUnavailable(f"weak isolation as root runs code under a uid of its own, which cannot read "
                                     f"the Python installation {path} ({directory} is closed to other users)")


def _ancestors(path: str) -> List[str]:
    """The directories above `path`, up to /."""
    parents = []
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        parents.append(path)
    return parents


def _run_uid(first_pid: int) -> int:
    return SANDBOX_UID_BASE + first_pid


def _call(result: int, what: str) -> None:
    if result != 0:
        raise JailUnavailable(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def _unshare(flags: int) -> None:
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(flags) != 0:
        raise JailUnavailable(f"unshare failed: {os.strerror(ctypes.get_errno())}; namespaces need root or user "
                              "namespaces: run there, or set allow_weak_isolation: true in the reward's params")
    if flags & _CLONE_NEWUSER:  # be root inside the new namespace, mapped to the caller outside
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as file:
                file.write(text)


def _become_namespace_init() -> None:
    """Fork: the child goes on as PID 1 of the new PID namespace (its exit kills every process in
    it); this process only waits for it and ends the same way."""
    child = os.fork()
    if child == 0:
        return
    os.closerange(0, MAX_OPEN_FILES * 16)
    _pid, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _call(_libc.mount(_c(source), _c(target), _c(fstype), flags, _c(data)), f"mount {target}")


def _c(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def _private_root(scratch: str, writable: bool) -> None:
    """Replace the file system view with a read-only tmpfs holding binds of the system and Python
    directories, a few devices and `scratch`; the old root is detached."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    new_root = os.path.join(os.path.dirname(scratch), "root")
    _mount("tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=64k,mode=755")
    for source, read_only in _binds(scratch, writable):
        _bind(source, new_root + source, read_only)
    _mount(None, new_root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(new_root)
    _call(_libc.syscall(_SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _call(_libc.umount2(b".", _MNT_DETACH), "umount old root")
    os.chdir("/")


def _bind(source: str, target: str, read_only: bool) -> None:
    """Show `source` at `target` (a symbolic link is copied as a link, to be followed in the new root)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.mkdir(target)
    else:
        open(target, "w").close()
    _mount(source, target, None, _MS_BIND | _MS_REC)
    if read_only:
        _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _kept_flags(source))


def _binds(scratch: str, writable: bool) -> List[Tuple[str, bool]]:
    """(path, read-only) pairs to show in the new root: the Python installation only where the
    system directories do not already hold it."""
    system = [path for path in SYSTEM_DIRS if os.path.lexists(path)]
    python = {os.path.realpath(prefix) for prefix in (sys.base_prefix, sys.prefix)}
    python = [path for path in python if not any(path == d or path.startswith(d + os.sep) for d in system)]
    devices = [(path, False) for path in DEVICES if os.path.exists(path)]
    return [(path, True) for path in system + python] + devices + [(scratch, not writable)]


def _kept_flags(source: str) -> int:
    """nosuid and nodev, plus the flags of the mount holding `source` that a read-only bind of it
    must keep (inside a user namespace the kernel refuses to clear them)."""
    flags = os.statvfs(source).f_flag
    return sum(ms for st, ms in ((os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV),
                                 (os.ST_NOEXEC, _MS_NOEXEC)) if flags & st) | _MS_NOSUID | _MS_NODEV


def _set_rlimits(memory_mb: int, cpu_s: int) -> None:
    for limit, value in ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_CPU, cpu_s),
                         (resource.RLIMIT_NPROC, MAX_PROCESSES), (resource.RLIMIT_FSIZE, MAX_FILE_BYTES),
                         (resource.RLIMIT_NOFILE, MAX_OPEN_FILES), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def _drop_privileges(uid: int | None) -> str:
    """Empty the capability bounding set, become `uid` when given, clear every capability, set
    no_new_privs; returns the layer's name. Raises if any capability is left."""
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    if any(_capabilities(header)):  # a caller without any has no bounding set to fear (and may not drop it)
        cap = 0
        while _libc.prctl(_PR_CAPBSET_READ, cap, 0, 0, 0) >= 0:
            _call(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"dropping capability {cap}")
            cap += 1
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _call(_libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")
    _call(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    if any(_capabilities(header)):
        raise JailUnavailable("capabilities survived capset; refusing to run untrusted code")
    _call(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _call(_libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
    return f"uid={os.getuid()}" if uid is not None else "nocaps"


def _capabilities(header: ctypes.Array) -> ctypes.Array:
    """This process's effective, permitted and inheritable capability words."""
    sets = (ctypes.c_uint32 * 6)()
    _call(_libc.capget(header, sets), "capget")
    return sets


def forbid_tracing() -> None:
    """Keep other processes of this uid from reading or tracing this one (the judge's guard
    where namespaces are unavailable)."""
    _call(_libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")

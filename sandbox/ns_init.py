"""Pid 1 of a namespace sandbox (sandbox/namespace.py); standard library only, run as
`python3 -I -S ns_init.py` by `unshare --mount --pid --net --ipc --uts --fork --kill-child`.

It reads its plan (JSON) from stdin, builds a fresh root on a tmpfs from read-only binds, pivots
into it, brings loopback up, then forks the server: unprivileged (another uid, or no capabilities
in a user namespace), no_new_privs, with rlimits. It stays as the namespace's init: reaps,
forwards SIGTERM to every process, exits with the server's status, and exits at once (taking the
whole pid namespace with it) when the harness's end of the watch pipe closes.
"""
import ctypes
import fcntl
import json
import os
import platform
import resource
import select
import shutil
import signal
import socket
import struct
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MNT_DETACH = 2
ST_TO_MS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 38, 47, 4
SIOCSIFFLAGS, IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40
INIT_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


class InitError(Exception):
    pass


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise InitError(f"{what}: {os.strerror(code)}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else str(s).encode()
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or fstype} on {target}")


def inherited_flags(path):
    """Flags of the mount at `path` that a bind remount must keep (locked in a user namespace)."""
    flag = os.statvfs(path).f_flag
    return sum(ms for st, ms in ST_TO_MS.items() if flag & st)


def mounts_under(target):
    """Mount points at or below `target`, parents first (from this namespace's mountinfo)."""
    top = os.path.realpath(target)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    return [p for p in dict.fromkeys(points) if p == top or p.startswith(top.rstrip("/") + "/")]


def bind(source, target, writable=False, devices=False):
    """Recursive: a host folder's submounts come along (a container's driver files bound into /usr, say), and
    each is remounted with the same restrictions."""
    mount(source, target, None, MS_BIND | (MS_REC if os.path.isdir(source) else 0))
    for point in mounts_under(target) if os.path.isdir(source) else [target]:
        flags = MS_BIND | MS_REMOUNT | MS_NOSUID | inherited_flags(point)
        flags |= 0 if writable else MS_RDONLY
        flags |= 0 if devices else MS_NODEV
        flags |= MS_NOEXEC if writable and not devices else 0
        mount(None, point, None, flags)


def inside(root, path):
    return os.path.join(root, path.lstrip("/"))


def make_target(target, is_dir):
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            open(target, "w").close()


def tmpfs(target, size_mb, mode, extra=0):
    os.makedirs(target, exist_ok=True)
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV | extra, f"size={size_mb}m,mode={mode}")


def build_root(plan):
    root = plan["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    scratch = inside(root, plan["scratch"])
    tmpfs(scratch, plan["tmpfs_mb"], "1777")  # first: binds under /tmp (an interpreter's site folder) go over it
    for link, target in plan["symlinks"]:
        make_target(os.path.dirname(inside(root, link)), True)
        os.symlink(target, inside(root, link))
    for path, text in plan["files"].items():
        make_target(inside(root, path), False)
        with open(inside(root, path), "w") as f:
            f.write(text)
    for source, target, writable in plan["binds"]:
        make_target(inside(root, target), os.path.isdir(source))
        bind(source, inside(root, target), writable)
    for path in plan["empty_dirs"]:
        make_target(inside(root, path), True)
    if plan["seed"] and os.path.isdir(plan["seed"]):
        seed_caches(plan["seed"], scratch, plan["cache_dirs"], plan["uid"], plan["gid"])
    build_dev(root, plan)
    os.makedirs(inside(root, "proc"), exist_ok=True)
    mount("proc", inside(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(inside(root, "sys"), exist_ok=True)
    try:
        mount("sysfs", inside(root, "sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except InitError as exc:
        print(f"ns_init: no /sys ({exc})", file=sys.stderr, flush=True)
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    enter_root(root)


def seed_caches(seed, scratch, names, uid, gid):
    """Copy the seed's cache folders into the scratch, owned by the server's user (only those: read-only binds
    of the host's folders may sit under the scratch too)."""
    for name in names:
        if not os.path.isdir(os.path.join(seed, name)):
            continue
        copied = os.path.join(scratch, name)
        shutil.copytree(os.path.join(seed, name), copied, symlinks=True, dirs_exist_ok=True)
        os.lchown(copied, uid, gid)
        for top, dirs, files in os.walk(copied):
            for entry in [*dirs, *files]:
                os.lchown(os.path.join(top, entry), uid, gid)


def build_dev(root, plan):
    dev = inside(root, "dev")
    tmpfs(dev, 1, "0755")
    for node in ["null", "zero", "full", "random", "urandom", "tty", *plan["devices"]]:
        source = os.path.join("/dev", node)
        if os.path.exists(source):
            make_target(os.path.join(dev, node), os.path.isdir(source))
            bind(source, os.path.join(dev, node), writable=True, devices=True)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx")]:
        os.symlink(target, os.path.join(dev, name))
    tmpfs(os.path.join(dev, "shm"), plan["tmpfs_mb"], "1777")
    mount(None, dev, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def enter_root(root):
    os.chdir(root)
    number = PIVOT_ROOT.get(platform.machine())
    if number is not None and libc.syscall(number, b".", b".") == 0:
        _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    else:
        os.chroot(".")
    os.chdir("/")


def loopback_up():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING))


def oom_score_adj(value):
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
    except OSError:
        pass  # not allowed in a user namespace


def drop_privileges(plan):
    oom_score_adj(0)
    for name, value in plan["rlimits"].items():
        limit = getattr(resource, f"RLIMIT_{name}")
        resource.setrlimit(limit, (value, value))
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last_cap + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if not plan["userns"]:
        os.setgroups([])
    os.setgid(plan["gid"])
    os.setuid(plan["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def run_server(plan):
    drop_privileges(plan)
    os.chdir(plan["cwd"])
    os.execve(plan["argv"][0], plan["argv"], plan["env"])


def exit_status(status):
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def supervise(server, watch):
    def forward(signum, _frame):
        try:
            os.kill(-1, signal.SIGTERM)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        ready, _, _ = select.select([watch], [], [], 0.5)
        if ready and not os.read(watch, 64):
            os._exit(137)  # the harness is gone: pid 1 exits, the kernel kills the rest
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                os._exit(INIT_FAILED)
            if pid == 0:
                break
            if pid == server:
                os._exit(exit_status(status))


def main():
    plan = json.loads(sys.stdin.read())
    watch = plan["watch_fd"]
    os.set_inheritable(watch, False)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        oom_score_adj(-1000)
        build_root(plan)
        loopback_up()
        socket.sethostname(plan["hostname"])
    except (InitError, OSError) as exc:
        print(f"NamespaceInitError: {exc}", file=sys.stderr, flush=True)
        os._exit(INIT_FAILED)
    server = os.fork()
    if server == 0:
        try:
            run_server(plan)
        except BaseException as exc:
            print(f"NamespaceInitError: cannot start the server: {exc!r}", file=sys.stderr, flush=True)
        os._exit(INIT_FAILED)
    supervise(server, watch)


if __name__ == "__main__":
    main()

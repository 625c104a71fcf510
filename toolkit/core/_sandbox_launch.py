"""The sandbox's launcher: the first process of a sandboxed run (see sandbox.py, which starts it).

Runs as `python -I -S _sandbox_launch.py CONFIG_JSON` with nothing imported but the standard library (it must
not import toolkit, torch or anything from the trainer's environment). In order:

1. new namespaces (unshare): network (no interface but a loopback that is down) and PID (no process outside is
   visible or can be signalled by number), and
   - run by an unprivileged user: a user namespace, in which that user's uid maps to itself;
   - run by root: a mount namespace instead, in which the code's whole file system is a new read-only root
     holding only the interpreter, the system libraries, the loader's files of /etc and four devices, plus the
     run's own directory (`build_view`): nothing else of the machine (no /etc/shadow, no /root, no home
     directories, no /proc) exists there;
2. fork: the child is PID 1 of the new namespace, so when it exits every process the code started dies with it;
   it also dies (PR_SET_PDEATHSIG) when this launcher is killed, which is how a timeout ends the whole tree;
3. in the child: run by root, it first becomes an unprivileged uid of its own (one per run, no supplementary
   groups, no capabilities left): root is exempt from RLIMIT_NPROC and reads any file, so the code never runs as
   root; then rlimits (CPU seconds, address space, processes, file size, open files, no core dumps), then
   Landlock: read and execute only the Python installation and system libraries, read and write only the
   sandbox's temporary directory, no TCP, no signals or abstract sockets outside the sandbox; then exec.

Exit status: the code's, or 128 + signal; 125 when the sandbox itself could not be set up (the reason on
stderr, prefixed "sandbox:").
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446

# Landlock filesystem rights by ABI version (include/uapi/linux/landlock.h)
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ABI1 = (1 << 13) - 1        # execute ... make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

__all__: list = []  # a script the sandbox runs, not an API

libc = ctypes.CDLL(None, use_errno=True)


STATUS_FD = None  # the trainer's status pipe: only the launcher writes it (closed on exec, the code never has it)


def fail(message):
    if STATUS_FD is not None:
        try:
            os.write(STATUS_FD, message.encode("utf-8", "replace")[:4000])
        except OSError:
            pass
    sys.stderr.write(f"sandbox: {message}\n")
    sys.stderr.flush()
    os._exit(125)


def check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        fail(f"{what} failed: {os.strerror(err)} (errno {err})")
    return ret


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def landlock_abi():
    return libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(abi, read_paths, read_files, rw_dirs, rw_files):
    fs = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    fields = [fs]
    if abi >= 4:
        fields.append(NET_BIND_TCP | NET_CONNECT_TCP)  # handled and never allowed: no TCP at all
    if abi >= 6:
        if len(fields) == 1:
            fields.append(0)
        fields.append(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    ruleset = check(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                                 ctypes.c_uint32(0)), "landlock_create_ruleset")
    read_dir = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    file_rights = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    rules = [(p, read_dir) for p in read_paths] + [(p, FS_READ_FILE) for p in read_files]
    rules += [(p, fs) for p in rw_dirs] + [(p, file_rights) for p in rw_files]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this system does not have
        if not os.path.isdir(path):
            access &= file_rights  # Landlock accepts only file rights on a file
        rule = PathBeneath(access, fd)
        check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule),
                           ctypes.c_uint32(0)), f"landlock_add_rule({path})")
        os.close(fd)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)),
          "landlock_restrict_self")
    os.close(ruleset)


# seccomp: refuse Unix-domain sockets (a path or abstract socket outside, e.g. a container runtime's or a
# terminal multiplexer's, would be a way out that neither the network namespace nor Landlock closes) and the
# calls that change file metadata (chmod, chown, utimes, xattrs), which Landlock does not cover.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {  # arch -> (socket, [metadata calls])
    "x86_64": (41, [90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198, 199]),
    "aarch64": (198, [52, 53, 452, 54, 55, 88, 5, 6, 7, 14, 15, 16]),
}
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
EACCES, EPERM = 13, 1


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]


def seccomp(machine):
    LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
    socket_nr, metadata = SYSCALLS[machine]
    prog = [(LD_W_ABS, 0, 0, 4), (JEQ_K, 1, 0, AUDIT_ARCH[machine]), (RET_K, 0, 0, RET_KILL_PROCESS),
            (LD_W_ABS, 0, 0, 0)]
    if machine == "x86_64":  # x32 system calls (nr | 0x40000000) are not what the numbers above mean
        prog += [(JGE_K, 0, 1, 0x40000000), (RET_K, 0, 0, RET_KILL_PROCESS)]
    for nr in metadata:
        prog += [(JEQ_K, 0, 1, nr), (RET_K, 0, 0, RET_ERRNO | EPERM)]
    prog += [(JEQ_K, 0, 3, socket_nr), (LD_W_ABS, 0, 0, 16), (JEQ_K, 0, 1, 1),  # socket(AF_UNIX, ...)
             (RET_K, 0, 0, RET_ERRNO | EACCES), (RET_K, 0, 0, RET_ALLOW)]
    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    check(libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")  # SECCOMP_MODE_FILTER


def limit(kind, value):
    resource.setrlimit(kind, (value, value))


def mount(source, target, fstype, flags, data=None):
    enc = (lambda x: None if x is None else x.encode())
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount({source} -> {target})")


def bind(source, target, *, read_only, devices=False):
    """`source` (a file or folder of the machine) at `target` in the new root; read-only unless asked."""
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if devices else MS_NODEV))


def build_view(cfg):
    """Run by root, in a new mount namespace: a new root file system of only what the code needs, then
    pivot_root into it (the old root is detached: no path leads back to it)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the machine's mounts
    root = cfg["view_root"]
    os.mkdir(root, 0o700)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    bound = []
    for path in sorted(cfg["read_paths"], key=len):
        if any(path == b or path.startswith(b.rstrip("/") + "/") for b in bound):
            continue  # inside a folder already there
        if os.path.islink(path) and os.path.dirname(path) == "/":  # /bin -> usr/bin on a merged /usr
            os.symlink(os.readlink(path), root + path)
            continue
        bind(path, root + path, read_only=True)
        bound.append(path)
    for path in cfg["read_files"] + cfg["rw_files"]:
        if os.path.exists(path):
            bind(path, root + path, read_only=True, devices=path.startswith("/dev/"))
    bind(cfg["workdir"], root + cfg["workdir"], read_only=False)
    old = root + "/.old-root"
    os.mkdir(old, 0o700)
    check(libc.syscall(SYS_PIVOT_ROOT[cfg["machine"]], root.encode(), old.encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old-root", MNT_DETACH), "umount(old root)")
    os.rmdir("/.old-root")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)  # the new root itself: read-only


def drop_root(uid, gid):
    """Become `uid`/`gid` (no supplementary groups): all capabilities go with root."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() == 0 or os.getegid() == 0 or os.getgroups():
        fail("could not leave root")


def launcher_gone(alive_fd):
    """Whether the launcher has exited: it holds the write end of this pipe open for its whole life, so the read
    end turns readable (end of file) only once it is gone. (In a PID namespace getppid() says nothing: 0.)"""
    import select

    return bool(select.select([alive_fd], [], [], 0)[0])


def child(cfg, alive_fd):
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if launcher_gone(alive_fd):
        os._exit(125)  # the launcher died before the death signal was armed
    if cfg["as_root"]:
        drop_root(cfg["run_uid"], cfg["run_gid"])
        # changing the uid cleared the death signal (the kernel resets it on a change of credentials): armed again,
        # or code that leaves the launcher's process group (setsid) would outlive a timeout that kills the launcher
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if launcher_gone(alive_fd):
            os._exit(125)
    os.close(alive_fd)
    lim = cfg["limits"]
    cpu = int(lim["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
    limit(resource.RLIMIT_AS, int(lim["memory_mb"]) << 20)
    limit(resource.RLIMIT_FSIZE, int(lim["max_file_mb"]) << 20)
    limit(resource.RLIMIT_NPROC, int(lim["max_processes"]))
    limit(resource.RLIMIT_NOFILE, 256)
    limit(resource.RLIMIT_CORE, 0)
    if cfg["landlock"]:
        landlock(cfg["landlock_abi"], cfg["read_paths"], cfg["read_files"], [cfg["workdir"]], cfg["rw_files"])
    if cfg["seccomp"]:
        seccomp(cfg["machine"])
    os.chdir(cfg["workdir"])
    if STATUS_FD is not None:
        os.set_inheritable(STATUS_FD, False)  # closed when the code starts: it cannot report as the sandbox
    try:
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except OSError as e:
        fail(f"cannot run {cfg['argv'][0]}: {e}")


def main():
    global STATUS_FD
    try:
        cfg = json.loads(sys.argv[1])
        STATUS_FD = cfg.get("status_fd")
        # die with the trainer: a trainer killed mid-run must not leave the tree running
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if os.getppid() != cfg["trainer_pid"]:
            os._exit(125)
        if cfg["as_root"]:
            # the run's directory belongs to the uid the code will run as (it was made by root, mode 0700)
            for folder, dirs, files in os.walk(cfg["workdir"]):
                for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
                    os.lchown(name, cfg["run_uid"], cfg["run_gid"])
            check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID), "unshare(mount, net, pid namespaces)")
            build_view(cfg)
        elif cfg["namespaces"]:
            uid, gid = os.getuid(), os.getgid()
            check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID), "unshare(user, net, pid namespaces)")
            write("/proc/self/setgroups", "deny")
            write("/proc/self/uid_map", f"{uid} {uid} 1")
            write("/proc/self/gid_map", f"{gid} {gid} 1")
    except Exception as e:  # a sandbox that cannot be set up is the sandbox's failure, never the code's
        fail(f"setting up the sandbox failed: {e!r}")
    alive_r, alive_w = os.pipe()  # the launcher keeps alive_w open until it exits (see launcher_gone)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            child(cfg, alive_r)
        except BaseException as e:  # never return into the launcher's code in the child
            fail(f"setting up the sandbox failed: {e!r}")
    os.close(alive_r)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()

"""Run code a model wrote, contained: as a tool the model calls, or as a reward that runs tests.

    from toolkit.core.sandbox import Sandbox
    result = Sandbox().run_python("print(sum(range(10)))")
    result.stdout, result.exit_code, result.timed_out       # '45\\n', 0, False

Each run is a fresh process tree (see _sandbox_launch.py for the order of the steps), and the code never runs as
root: run by root (most training containers), the launcher builds a new read-only root file system of only the
interpreter, the system libraries, the loader's files of /etc, four devices and the run's directory (in a mount
namespace of its own), and the code runs there as an unprivileged uid drawn per run, with no capabilities, so
root-only files are not even there and RLIMIT_NPROC (from which the kernel exempts root) holds; run by an
unprivileged user, it runs as that user in a user namespace. Then, either way:

- **no network**: its own network namespace, whose only interface (loopback) is down; with Landlock ABI >= 4
  TCP bind/connect are refused as well;
- **no view of other processes**: its own PID namespace; its first process is PID 1 there, and when it exits or is
  killed every process the code started is killed with it (fork bombs, daemons that called setsid); with Landlock
  ABI >= 6 it cannot signal anything outside the sandbox;
- **files**: Landlock lets it read and execute only the Python installation, the system libraries and of /etc
  only the loader's files (not the trainer's working directory, its checkpoints, the home directory, /etc/passwd
  or /proc of other processes), and write only inside its own temporary directory, which is removed afterwards;
- **limits**: CPU seconds, address space, process count, file size and open files (rlimits), a wall-clock timeout
  after which the whole tree is killed, and stdout/stderr truncated to `max_output_bytes` each (a flood of
  output is cut, and the run killed once it is far past the cap).

Why this and not bubblewrap or containers: everything above is in the Linux kernel and reachable from the standard
library by an unprivileged user (user namespaces, Landlock), so it works in a pip install with no setuid helper,
no daemon and no package from the system. Where the kernel lacks a piece (user namespaces disabled, Landlock
before 5.13) `Sandbox()` refuses to run and says which piece and how to enable it; `Sandbox(strict=False)` runs
with what is there and `result.protections` lists what was active.

The sandbox runs nothing in the trainer's process: a hostile snippet can at worst use its own limits.
`result.protections` says what held for a run, including who the code ran as. What it does not guarantee: it is
not a VM (a kernel exploit escapes any of this); docs/agents.md lists the threats and what stops each.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "sandbox_support"]

_LAUNCHER = str(Path(__file__).with_name("_sandbox_launch.py"))
_SYSTEM_READ = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.conf.d")
# Of /etc only what the dynamic loader and the time module read: not passwd, shadow, sudoers, ssh keys or the
# machine's configuration
_FILES_READ = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/dev/urandom", "/dev/random", "/dev/zero")
_DEVICES_RW = ("/dev/null",)
# Run by root, the code runs as an unprivileged uid of its own, drawn per run from this range (no account needs to
# exist for it): root is exempt from RLIMIT_NPROC and may read any file, so the code never runs as root.
_RUN_UIDS = range(2_000_000_000, 2_100_000_000)


class SandboxUnavailable(RuntimeError):
    """The kernel lacks a protection the sandbox needs (and `strict=True`)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. `wall_seconds`: the whole tree is killed after this long. `cpu_seconds`: CPU time of
    the code's first process (SIGXCPU, then SIGKILL a second later). `memory_mb`: address space of each process.
    `max_processes`: processes and threads of this user inside the sandbox. `max_file_mb`: largest file it may
    write. `max_output_bytes`: kept of stdout and of stderr each; past 64x that the run is killed."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_processes: int = 64
    max_file_mb: int = 16
    max_output_bytes: int = 16_384

    def __post_init__(self):
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "max_processes", "max_file_mb", "max_output_bytes"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"SandboxLimits.{name}: must be > 0, got {value!r}.")


@dataclass
class SandboxResult:
    """The outcome of one run. `exit_code`: the code's exit status, or -N when signal N killed it (None when the
    sandbox killed it on timeout or output flood). `ok`: exited 0 in time."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    seconds: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    killed_reason: str | None = None   # "timeout" | "output flood" | None
    protections: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def as_text(self, limit: int = 2000) -> str:
        """stdout, then stderr and how the run ended when it did not end well: what a tool message shows."""
        parts = [self.stdout[:limit]]
        if self.stderr.strip():
            parts.append(self.stderr[-limit:])
        if self.timed_out:
            parts.append(f"[killed: no result after {self.seconds:.1f} s]")
        elif self.killed_reason:
            parts.append(f"[killed: {self.killed_reason}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit status {self.exit_code}]")
        return "\n".join(p for p in parts if p)


@lru_cache(maxsize=1)
def sandbox_support() -> dict[str, Any]:
    """Which protections this kernel offers an unprivileged process (probed once, in a throwaway process)."""
    probe = ("import ctypes, os\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))\n"
             "ns = libc.unshare(0x10000000 | 0x40000000 | 0x20000000) == 0\n"
             "print(abi, int(ns))\n")
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30)
        abi, ns = (int(x) for x in out.stdout.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        abi, ns = -1, 0
    import platform

    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    return {"namespaces": bool(ns), "landlock_abi": max(abi, 0), "linux": sys.platform.startswith("linux"),
            "machine": platform.machine(), "as_root": as_root, "root_view": as_root and _probe_root_view()}


def _probe_root_view() -> bool:
    """Whether this root can build the sandbox's view: a mount, network and PID namespace and a tmpfs mounted in
    it (a container's root without CAP_SYS_ADMIN cannot)."""
    probe = ("import ctypes, os, tempfile\n"
             "libc = ctypes.CDLL(None, use_errno=True)\n"
             "ok = libc.unshare(0x00020000 | 0x40000000 | 0x20000000) == 0\n"
             "ok = ok and libc.mount(None, b'/', None, ctypes.c_ulong(16384 | (1 << 18)), None) == 0\n"
             "d = tempfile.mkdtemp()\n"
             "ok = ok and libc.mount(b'tmpfs', d.encode(), b'tmpfs', ctypes.c_ulong(0), b'size=64k') == 0\n"
             "libc.umount2(d.encode(), 2)\n"
             "os.rmdir(d)\n"
             "print(int(ok))\n")
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() == "1"
    except (OSError, subprocess.SubprocessError):
        return False


def _read_paths() -> list[str]:
    """The Python installation (the venv and the interpreter it was made from) and the system libraries."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable)), *_SYSTEM_READ}
    paths |= {os.path.realpath(p) for p in list(paths)}
    return sorted(p for p in paths if p and os.path.exists(p))


class Sandbox:
    """Runs code contained (see the module docstring). `strict`: refuse to run when the kernel lacks user
    namespaces or Landlock (the default); False runs with what is there. `python`: the interpreter inside (default:
    the trainer's, so the same packages are importable)."""

    def __init__(self, limits: SandboxLimits | None = None, *, strict: bool = True, python: str | None = None):
        self.limits = limits or SandboxLimits()
        self.python = python or sys.executable
        support = sandbox_support()
        missing = []
        if not support["linux"]:
            missing.append("Linux (namespaces and Landlock are Linux kernel features)")
        root_view = support["as_root"] and support["root_view"]  # run by root: mount namespace, no user namespace
        if not support["namespaces"] and not root_view:
            missing.append("unprivileged user namespaces (no network/PID isolation): enable them with "
                           "`sysctl kernel.unprivileged_userns_clone=1` (Debian) or "
                           "`sysctl user.max_user_namespaces=15000`, or allow them in the container's seccomp profile")
        if support["landlock_abi"] < 3:
            missing.append(f"Landlock ABI >= 3 (found {support['landlock_abi']}; below 3 files outside cannot be "
                           "kept from being truncated): Linux >= 6.2 with `lsm=...,landlock` on the kernel command "
                           "line")
        if support["as_root"] and not support["root_view"]:
            missing.append("as root, a mount namespace of its own (CAP_SYS_ADMIN), in which the code runs as an "
                           "unprivileged uid on a root file system of only the interpreter and system libraries: "
                           "this root lacks it (a container without CAP_SYS_ADMIN); run the trainer as an "
                           "unprivileged user instead, with user namespaces allowed")
        if support["machine"] not in ("x86_64", "aarch64"):
            missing.append(f"a seccomp filter for {support['machine']} (Unix sockets and file-metadata calls are "
                           "refused by system-call number, known here for x86_64 and aarch64)")
        if missing and strict:
            raise SandboxUnavailable("the sandbox cannot contain code on this machine; missing: " + "; ".join(missing)
                                     + ". Sandbox(strict=False) runs with the protections that are available.")
        self.missing = missing
        # the path each run takes: root's own view (the code as an unprivileged uid), or a user namespace, or (only
        # with strict=False, when neither is available) none
        self.mode = "root_view" if root_view else "user_namespace" if support["namespaces"] else "none"
        isolated = self.mode != "none"
        self.protections = {
            "network_namespace": isolated, "pid_namespace": isolated,
            # who the code runs as, and so who RLIMIT_NPROC (max_processes) is enforced for
            "runs_as": {"root_view": "an unprivileged uid of its own (the trainer runs as root)",
                        "user_namespace": f"the trainer's uid {os.getuid()} in a user namespace",
                        "none": f"the trainer's uid {os.getuid()}, without namespaces"}[self.mode],
            # root is exempt from RLIMIT_NPROC: without the view a root trainer's code would run as root
            "max_processes_enforced": self.mode != "none" or not support["as_root"],
            "filesystem_view": ("a new read-only root: the interpreter, system libraries, the loader's /etc files, "
                                "four devices, the run's directory") if root_view else "the machine's, limited by "
                                                                                     "Landlock",
            "landlock_abi": support["landlock_abi"], "landlock_filesystem": support["landlock_abi"] >= 1,
            "landlock_no_tcp": support["landlock_abi"] >= 4, "landlock_signal_scope": support["landlock_abi"] >= 6,
            "seccomp": support["machine"] in ("x86_64", "aarch64") and support["linux"],
            "rlimits": True, "wall_timeout": True}

    def run_python(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None,
                   args: list[str] | None = None) -> SandboxResult:
        """Run `code` as a Python script (main.py in a fresh temporary directory, with `files` beside it)."""
        return self.run([self.python, "-E", "-s", "main.py", *(args or [])], stdin=stdin,
                        files={"main.py": code, **(files or {})})

    def run(self, argv: list[str], *, stdin: str = "", files: dict[str, str] | None = None) -> SandboxResult:
        """Run `argv` (argv[0] an absolute path) in a fresh temporary directory holding `files`."""
        if not argv or not os.path.isabs(argv[0]):
            raise ConfigError(f"Sandbox.run: argv[0] must be an absolute path, got {argv[:1]!r}.")
        workdir = tempfile.mkdtemp(prefix="toolkit-sandbox-")
        try:
            for name, text in (files or {}).items():
                target = Path(workdir, name).resolve()
                if Path(workdir).resolve() not in target.parents:
                    raise ConfigError(f"Sandbox.run: file name {name!r} points outside the sandbox directory.")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
            return self._launch(argv, workdir, stdin)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _launch(self, argv: list[str], workdir: str, stdin: str) -> SandboxResult:
        support = sandbox_support()
        # stdin from a file, not a pipe: writing a pipe the code never reads would block before any timeout runs
        stdin_path = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".stdin")
        with open(stdin_path, "wb") as f:
            f.write(stdin.encode("utf-8"))
        status_r, status_w = os.pipe()
        run_id = random.SystemRandom().choice(_RUN_UIDS)
        cfg = {
            "argv": argv, "workdir": workdir, "limits": asdict(self.limits), "status_fd": status_w,
            "trainer_pid": os.getpid(), "machine": support["machine"],
            "namespaces": self.mode == "user_namespace", "landlock": support["landlock_abi"] >= 1,
            "seccomp": bool(self.protections["seccomp"]),
            "landlock_abi": support["landlock_abi"], "read_paths": _read_paths(),
            "read_files": [f for f in _FILES_READ if os.path.exists(f)], "rw_files": list(_DEVICES_RW),
            "as_root": self.mode == "root_view", "run_uid": run_id, "run_gid": run_id, "view_root": workdir + ".root",
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"},
        }
        started = time.monotonic()
        proc = None
        try:
            with open(stdin_path, "rb") as stdin_file:
                proc = subprocess.Popen([self.python, "-I", "-S", _LAUNCHER, json.dumps(cfg)], cwd=workdir,
                                        stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, close_fds=True, pass_fds=(status_w,))
            os.close(status_w)
            status_w = -1
            out, err, truncated, reason = _collect(proc, started + self.limits.wall_seconds,
                                                   self.limits.max_output_bytes)
            if reason is not None:
                _kill_tree(proc)
            code = proc.wait()
            status = os.read(status_r, 8192).decode("utf-8", "replace")
        finally:
            if proc is not None:
                _kill_tree(proc)  # whatever is left in the session, also when this thread is interrupted
                proc.wait()
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            os.unlink(stdin_path)
            if os.path.isdir(cfg["view_root"]):  # the new root's mount point (its mount was the sandbox's own)
                os.rmdir(cfg["view_root"])
        seconds = time.monotonic() - started
        err_text = err.decode("utf-8", "replace")
        if status:  # written only by the launcher, before the code starts: the code cannot forge it
            raise SandboxUnavailable(f"sandbox: {status}")
        exit_code = None if reason is not None else (code if code < 128 else -(code - 128))
        return SandboxResult(stdout=out.decode("utf-8", "replace"), stderr=err_text, exit_code=exit_code,
                             timed_out=reason == "timeout", seconds=seconds, stdout_truncated=truncated[0],
                             stderr_truncated=truncated[1], killed_reason=reason, protections=dict(self.protections))


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, deadline: float, cap: int
             ) -> tuple[bytes, bytes, tuple[bool, bool], str | None]:
    """Read stdout/stderr until both close, the deadline passes or the output floods.
    Returns (stdout, stderr, (stdout truncated, stderr truncated), why it was stopped or None)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    seen = {proc.stdout: 0, proc.stderr: 0}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    reason = None
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            reason = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            seen[key.fileobj] += len(chunk)
            room = cap - len(bufs[key.fileobj])
            if room > 0:
                bufs[key.fileobj] += chunk[:room]
            if seen[key.fileobj] > 64 * cap:
                reason = "output flood"
        if reason:
            break
    sel.close()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    return (bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]),
            (seen[proc.stdout] > cap, seen[proc.stderr] > cap), reason)

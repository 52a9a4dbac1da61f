"""Ranks forked from one interpreter that imported torch once: the test suite's launcher.

Why: a fresh interpreter spends about 3 s of CPU importing torch (its CUDA build, here on
CPU). A 4-rank job on 2 cores spent about 6 s of its wall time on that alone, and the suite
starts hundreds of ranks. Forked from a process that has already imported torch, a rank starts
in milliseconds and is otherwise the same: a real process of its own, with its own gloo groups,
its own pid and session, its own exit status.

Not multiprocessing's "forkserver" (which `check/jobs.py` uses): its children run a function
and leave by os._exit, so atexit handlers and interpreter shutdown never run, and the tests of
a background save that the end of the process must wait for need both; they also could not
take a pipe of the launcher's as stdout or start a session of their own.

The protocol, one zygote per interpreter and import-time environment, started by the first
launch that asks for it (`Zygote.get`), living until that launcher process exits:

1. the launcher starts `python -u -c BOOT zygote.py SOCKET`; the zygote imports torch (PRELOAD)
   with OMP_NUM_THREADS=1, checks that it is a single thread (fork copies only the caller), and
   listens on an AF_UNIX SOCK_SEQPACKET socket;
2. per rank, the launcher connects and sends one message: the command line, working directory
   and whole environment as JSON, with the write end of the rank's output pipe attached
   (SCM_RIGHTS);
3. the zygote forks. The child starts a session of its own, takes the pipe as stdout and
   stderr, /dev/null as stdin, the directory and environment it was sent, and sys.argv and
   sys.path[0] as `python script.py` or `python -m module` would set them, then runs the script
   as __main__ at the zygote's top level: SystemExit, an uncaught exception, atexit handlers
   and interpreter shutdown happen as in a fresh interpreter;
4. the zygote answers with the child's pid, and, when it has reaped the child, its exit code
   (negative for a signal, as subprocess reports it); then closes the connection.

What differs from a fresh interpreter, and why it does not matter to the tests that use it:
- torch and numpy were imported before the rank's environment was set. Torch's import-time
  variables (IMPORT_TIME_ENV) must equal the zygote's, or `launch` falls back to a fresh
  interpreter; the launcher sets OMP_NUM_THREADS=1 for every rank anyway.
- Every forked rank has the zygote's str hash seed, where fresh interpreters have one each.
  A rank's code that relied on set or dict order of str keys being the same across ranks
  would pass here and could fail in a real job; ckptdoctor's protocols order what they send.
  The jobs that also run outside the suite (MOVA under accelerate launch, `ckptdoctor repro`,
  the installed wheel's jobs) start fresh interpreters.
- The rank's parent is the zygote, not the launcher; the launcher sees it through `ForkedRank`,
  which answers as much of subprocess.Popen as the launcher uses.

This file imports nothing of ckptdoctor: the zygote runs it as a script, so that no module of
the package is imported before a rank's environment is set.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile

PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor")
# variables read when torch (or numpy, OpenMP, the BLAS) is imported, not when it is used
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONPATH", "PYTHONHASHSEED",
                   "LD_PRELOAD", "LD_LIBRARY_PATH")
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH")
BOOT = "import sys; p = sys.argv[1]; exec(compile(open(p).read(), p, 'exec'))"
MESSAGE_MAX = 1 << 20


def import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k in IMPORT_TIME_ENV or k.startswith(IMPORT_TIME_PREFIXES)}


# -- the launcher's side -----------------------------------------------------------------------

class ForkedRank:
    """A rank the zygote forked, seen as the launcher sees a subprocess.Popen."""

    def __init__(self, conn: socket.socket, stdout):
        self._conn = conn
        self.stdout = stdout
        self.returncode: int | None = None
        self.pid = json.loads(conn.recv(MESSAGE_MAX))["pid"]

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._take_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self._take_exit()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def _take_exit(self) -> None:
        message = self._conn.recv(MESSAGE_MAX)
        self.returncode = json.loads(message)["exit"] if message else -1  # -1: the zygote itself is gone
        self._conn.close()


class Zygote:
    """A running zygote for one interpreter and import-time environment."""

    _running: dict[tuple, Zygote] = {}

    def __init__(self, python: str, env: dict):
        self._dir = tempfile.mkdtemp(prefix="ckptdoctor-zygote-")
        self.address = os.path.join(self._dir, "socket")
        self.proc = subprocess.Popen([python, "-u", "-c", BOOT, __file__, self.address], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        atexit.register(self.close)
        ready = self.proc.stdout.readline().decode()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the zygote did not start: {ready}{self.proc.stdout.read().decode()[-2000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    @classmethod
    def get(cls, python: str, env: dict) -> Zygote | None:
        """The zygote for `python` with `env`'s import-time variables; None when it cannot run
        (the caller then starts a fresh interpreter)."""
        key = (python, tuple(sorted(import_time_env(env).items())))
        zygote = cls._running.get(key)
        if zygote is None or zygote.proc.poll() is not None:
            try:
                zygote = cls._running[key] = Zygote(python, env)
            except (OSError, RuntimeError):
                return None
        return zygote

    def fork(self, argv: list[str], env: dict) -> ForkedRank:
        """Start `python <argv>` with `env`, in this directory, as a rank forked from this zygote."""
        read, write = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.address)
            request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd()}).encode()
            socket.send_fds(conn, [request], [write])
        finally:
            os.close(write)
        return ForkedRank(conn, os.fdopen(read, "rb"))


# -- the zygote's side --------------------------------------------------------------------------

def serve(address: str) -> dict:
    """The zygote's loop; returns only in a forked child, with the request it is to run."""
    os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    import importlib
    for name in PRELOAD:
        importlib.import_module(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        print(f"not ready: {threads} threads after importing torch; a fork would copy only one")
        sys.exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    parent, children = os.getppid(), {}  # pid -> the connection that waits for its exit code
    print("ready")
    while os.getppid() == parent:
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, MESSAGE_MAX, 1)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                return _become_rank(json.loads(message), fds[0])
            os.close(fds[0])
            conn.send(json.dumps({"pid": pid}).encode())
            children[pid] = conn
        _reap(children)
    sys.exit(0)  # the launcher is gone


def _reap(children: dict) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            conn.close()


def _become_rank(request: dict, output: int) -> dict:
    os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(stdin)
    os.close(output)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0], as -m does
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    return request


def run_as_main(request: dict) -> None:
    import runpy

    argv = request["argv"]
    if argv[0] == "-m":
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    run_as_main(serve(sys.argv[2]))

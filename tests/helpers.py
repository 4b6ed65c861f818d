"""Small shared pieces for the tests: a tiny config, the CLI in a subprocess or in-process.

Every process a test starts through these helpers runs in a session (process
group) of its own and carries a tag in its environment, which its descendants
inherit: a local cluster's members, which the launcher starts in sessions of
their own and which outlive a killed launcher, are found by it too. `kill`
ends a process with all its descendants; `killed_when_done` (an autouse
fixture in `conftest.py`) ends whatever a test started, however it ended.

`run_command` forks a `python -m MODULE` command (and a `python -c SCRIPT` one,
through `tests.fresh_process`) from a server that imported
TensorFlow once (`towerflow.forkserver`; about 4.5 s of CPU less a command), where
the test's environment is the one the server started with (a launcher,
`trainer.launch`, gets its own server forked with it, so its members import
nothing again either); `TOWERFLOW_TEST_FORK=0` and any failure to fork start
a process of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import itertools
import json
import locale
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import configs.default
from strategies.devices import CPU_POOL_VARIABLE
from towerflow import forkserver
from towerflow.processes import member_identity
from trainer.cli import MEMBER_MODULES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The logical CPUs the test process splits its CPU into (tests/conftest.py).
LOGICAL_CPUS = 4
# Generous: a loaded machine is 2-3x slower, and a test's bound must not be what fails there.
TIMEOUT_S = 600

# The environment variable holding the tags of a process's test-started ancestors
# (space-separated, so a test that runs pytest in a child keeps both tags).
TAG_VARIABLE = "TOWERFLOW_TEST_TAGS"
_started: list[tuple[str, subprocess.Popen]] = []  # (tag, process), in start order
_serial = itertools.count()
FORK_VARIABLE = "TOWERFLOW_TEST_FORK"  # "0": `run_command` forks nothing
# What a forked command's environment may hold apart from the server's (read after start-up).
# (`devices.CPU_POOL_VARIABLE`: a forked command's runtime reads it when it starts; gRPC
# reads the proxy variables when it opens a channel.)
_PROXIES = {"http_proxy", "https_proxy", "grpc_proxy", "no_proxy", "no_grpc_proxy"}
_PER_COMMAND = {
    "TF_CONFIG",
    TAG_VARIABLE,
    "PYTEST_CURRENT_TEST",
    FORK_VARIABLE,
    CPU_POOL_VARIABLE,
    *_PROXIES,
    *(name.upper() for name in _PROXIES),
}
_forks: forkserver.Client | None = None  # started at the first command it forks
# The commands that fork members of their own: forked with a server for them (`Client.fork`).
# (As `command[2:3]`: a command may have fewer words.)
LAUNCHERS = (["trainer.launch"], ["trainer.sweep"])

# The start of a script a test runs in a process of its own (`run_command`):
# `bare_parameter_server()`, a bare `tf.distribute` ParameterServerStrategy over
# in-process servers on 127.0.0.1 (a chief, a worker and 2 ps members), and
# `rss_mb()`, the process's memory once its garbage is freed.
IN_PROCESS_CLUSTER = """
import gc, socket
import tensorflow as tf

def address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"

def bare_parameter_server():
    global servers  # they serve as long as the script runs
    jobs = {"chief": [address()], "worker": [address()], "ps": [address(), address()]}
    cluster = tf.train.ClusterSpec(jobs)
    members = (("worker", 0), ("ps", 0), ("ps", 1))
    servers = [tf.distribute.Server(cluster, job, task) for job, task in members]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type="chief", task_id=0, rpc_layer="grpc"
    )
    return tf.distribute.experimental.ParameterServerStrategy(resolver)

def rss_mb():
    gc.collect()  # what is garbage, freed: only what is held counts
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024
"""


def tiny_config(**overrides):
    """The default config made small and fast; `overrides` are "a.b": value pairs."""
    config = configs.default.get_config()
    config.devices.logical_cpus = 4
    config.train.steps = 20
    config.train.steps_per_loop = 5
    config.train.checkpoint_every = 10
    config.train.export = False
    config.eval.every = 0
    config.model.hidden_units = (32,)
    config.model.dropout = 0.0
    config.update_from_flattened_dict(overrides)
    return config


def config_flags(config, fields: tuple[str, ...]) -> list[str]:
    """`--config.FIELD=VALUE` for each dotted field of `config`: that config, for a subprocess."""
    flags = []
    for field in fields:
        value = config
        for key in field.split("."):
            value = value[key]
        flags.append(f"--config.{field}={value}")
    return flags


def one_line_error(match: str, fn, *args) -> str:
    """The message of the UserError `fn(*args)` raises; it must match `match` and be one line."""
    import pytest

    from towerflow.errors import UserError

    with pytest.raises(UserError, match=match) as caught:
        fn(*args)
    message = str(caught.value)
    assert "\n" not in message, "user errors are one line"
    return message


def _env(keep_tf_config: bool = False) -> dict[str, str]:
    """The environment a test's trainer runs in: quiet TF, this repo importable."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if not keep_tf_config:
        env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def run_cli(
    *args: str,
    cwd: str,
    timeout: float = TIMEOUT_S,
    module: str = "trainer",
    keep_tf_config=False,
) -> subprocess.CompletedProcess:
    """Runs `python -m MODULE ARGS` in `cwd` (default the trainer), as a user would."""
    return run_command([sys.executable, "-m", module, *args], cwd, timeout, keep_tf_config)


def run_command(
    command: list[str], cwd: str, timeout: float = TIMEOUT_S, keep_tf_config=False
) -> subprocess.CompletedProcess:
    """Runs `command` in `cwd`, this repository importable, stdout and stderr captured.

    Whatever happens (it ends, it times out, the test is interrupted), nothing
    it started is left running.

    Raises:
      subprocess.TimeoutExpired: it ran over `timeout` seconds; its output so
        far is printed to stderr (pytest shows it with the failure).
    """
    env = _env(keep_tf_config)
    proc = _forked(command, cwd, env) or spawn(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    # Once it ends, what it left behind goes too: such a process may hold its pipes
    # open, and `communicate` waits for the pipes to close.
    killer = threading.Thread(target=_kill_when_it_ends, args=(proc,), daemon=True)
    killer.start()
    try:
        out, err = proc.communicate(timeout=timeout)
        killer.join()  # the pipes may close before what it left behind is killed
    except subprocess.TimeoutExpired:
        kill(proc)
        out, err = proc.communicate()
        print(
            f"{' '.join(command)} ran over {timeout} s:\n{out[-3000:]}\n{err[-3000:]}",
            file=sys.stderr,
        )
        raise
    finally:
        kill(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


class _Signalled(forkserver.Forked):
    """A command forked from the server, signalled as a `Popen` is (until it is reaped)."""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped: the pid is still its own
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _ForkedCommand(_Signalled):
    """A command forked from the server, its stdout and stderr piped: `Popen.communicate` too."""

    def __init__(self, proc: forkserver.Forked, stdout: int, stderr: int):
        super().__init__(proc.pid, proc.args)
        self.stdout, self.stderr = os.fdopen(stdout, "rb"), os.fdopen(stderr, "rb")
        self._read = {self.stdout: b"", self.stderr: b""}
        self._readers = [
            threading.Thread(target=self._read_all, args=(stream,), daemon=True)
            for stream in self._read
        ]
        for reader in self._readers:
            reader.start()

    def _read_all(self, stream) -> None:
        self._read[stream] = stream.read()  # all of it, once every writer is gone

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Its stdout and stderr, as `Popen(text=True)` reads them, once both close and it ends."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - time.monotonic()))
        return _text(self._read[self.stdout]), _text(self._read[self.stderr])


class _ForkedLive(_Signalled):
    """A command forked from the server, stdout and stderr on one pipe read as it runs.

    As `Popen(stdout=PIPE, stderr=STDOUT, text=True)`: `stdout` yields its lines
    as they come; `communicate` returns the rest of them (and None).
    """

    def __init__(self, proc: forkserver.Forked, output: int):
        super().__init__(proc.pid, proc.args)
        self.stdout = open(output, encoding=locale.getpreferredencoding(False), errors="replace")
        self.stderr = None

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait()
        return rest[0], None


def _text(data: bytes) -> str:
    """`data` decoded, its newlines translated, as `Popen(text=True)` gives it."""
    text = data.decode(locale.getpreferredencoding(False), errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _forked(
    command: list[str], cwd: str, env: dict[str, str], live: bool = False
) -> _ForkedCommand | _ForkedLive | None:
    """`command` forked from the server, tagged for `kill`; None where it cannot be.

    Its stdout and stderr are captured apart (`_ForkedCommand`), or with `live`
    read together as it runs (`_ForkedLive`).
    """
    global _forks
    if os.environ.get(FORK_VARIABLE, "1") == "0" or not os.path.isdir(cwd):
        return None
    if _comparable(env) != _comparable(_SERVER_ENV):  # the test changed what imports read
        return None
    if _forks is None:
        # Labelled: a forked command's command line is the server's, and would otherwise
        # show the first command it forked (another test's directory, in a search for its own).
        _forks = forkserver.Client(
            server_env=_comparable(_SERVER_ENV), label=["tests.helpers"], preload=MEMBER_MODULES
        )
        _forks.enabled = True
        atexit.register(_forks.close)
    if command[:2] == [sys.executable, "-c"]:  # a script: run as `python -c` would run it
        command = [sys.executable, "-m", "tests.fresh_process", *command[2:]]
    tag, env = _tagged(env)
    pipes = [os.pipe() for _ in range(1 if live else 2)]
    try:
        proc = _forks.fork(
            command,
            env,
            [write for _, write in pipes],
            cwd=str(cwd),
            server=_starts_processes(command),
        )
    finally:
        for _, write in pipes:
            os.close(write)
    if proc is None:
        for read, _ in pipes:
            os.close(read)
        return None
    reads = [read for read, _ in pipes]
    forked = _ForkedLive(proc, *reads) if live else _ForkedCommand(proc, *reads)
    _started.append((tag, forked))
    return forked


def _starts_processes(command: list[str]) -> bool:
    """Whether `command` starts processes of its own (a launcher, a trainer's `local:N` servers).

    Those are forked with a server of their own (`forkserver.Client.fork`).
    """
    local_service = any(word.startswith("--config.data.service=local:") for word in command)
    return command[2:3] in LAUNCHERS or local_service


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in _PER_COMMAND}


_SERVER_ENV = _env()  # the forked commands' server's, less `_PER_COMMAND`


def cli_in_process(*args: str, capsys, cwd=None) -> tuple[int, str, str]:
    """Runs `towerflow ARGS` in this process: the command's flag parsing, main and error handling.

    For what a subprocess would add nothing to (a listing, a refusal, a rerun's
    lines); `run_cli` keeps a real process for the command's own exits. The test
    process has 4 logical CPUs (tests/conftest.py), so the config says so unless
    `args` set `devices.logical_cpus`. `cwd`: the directory it runs in (default:
    this process's), as a user's shell would be in.

    Returns:
      The exit code (0 when main returned), stdout and stderr.
    """
    from absl import flags

    from trainer import cli

    cpus = [f"--config.devices.logical_cpus={LOGICAL_CPUS}"]
    cpus = [] if any("logical_cpus" in a for a in args) else cpus
    argv = ["towerflow", *args, *cpus]
    defined = cli.define_flags(flags.FlagValues(), argv)
    capsys.readouterr()
    code = 0
    before = os.getcwd()
    try:
        os.chdir(cwd or before)
        cli.guarded(functools.partial(cli.main, defined))(cli.parse_flags(defined, argv))
    except SystemExit as exit:
        code = 0 if exit.code is None else exit.code
    finally:
        os.chdir(before)
    if code:  # a failed run's frames, and its input iterators, end here, not in a later test
        gc.collect()  # (as conftest's `iterators_end_with_the_test`)
    out, err = capsys.readouterr()
    return code, out, err


def start_cli(*args: str, cwd, module: str = "trainer") -> subprocess.Popen | _ForkedLive:
    """Starts `python -m MODULE ARGS` and returns it running; stdout (and stderr) piped.

    Forked where `run_command` would fork it (a launcher's members are then
    found by `pid_of`, not by their command line). The test's end kills it (and
    what it started) if it still runs.
    """
    command, env = [sys.executable, "-m", module, *args], _env()
    return _forked(command, str(cwd), env, live=True) or spawn(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def start_member(tf_config: str, *args: str, cwd) -> subprocess.Popen | _ForkedCommand:
    """Starts `python -m trainer ARGS` as one member of a cluster; stdout and stderr piped apart.

    The test's end kills it (and what it started) if it still runs.
    """
    command, env = [sys.executable, "-m", "trainer", *args], {**_env(), "TF_CONFIG": tf_config}
    return _forked(command, str(cwd), env) or spawn(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def launch(*args: str, cwd: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Runs `python -m trainer.launch ARGS`: a local cluster on 127.0.0.1."""
    return run_cli(*args, cwd=cwd, timeout=timeout, module="trainer.launch")


def assert_exit(
    result: subprocess.CompletedProcess | subprocess.Popen, code: int = 0, output: str | None = None
) -> None:
    """`result` (a finished command or process) exited with `code`; else its output's tail shows.

    Args:
      result: a `subprocess.run` result, or a `Popen` that has ended.
      code: the exit status expected.
      output: what it printed, when `result` holds no text (a `Popen` read by the test);
        None shows a `CompletedProcess`'s stdout and stderr.
    """
    if output is None:
        output = (result.stdout or "")[-4000:] + (result.stderr or "")[-3000:]
    assert result.returncode == code, (
        f"exit {result.returncode}, expected {code}:\n{output[-7000:]}"
    )


def launched(
    *args: str, cwd, timeout: float = TIMEOUT_S, code: int = 0
) -> subprocess.CompletedProcess:
    """`launch(ARGS)` on a local cluster, asserted to exit with `code` (output tail if not)."""
    result = launch(*args, cwd=str(cwd), timeout=timeout)
    assert_exit(result, code)
    return result


def train_on_cluster(
    tmp_path: pathlib.Path, *trainer_flags: str, workers: int = 2, ps: int = 1
) -> dict:
    """Trains on a local cluster into `tmp_path / "model"`; returns its results.json.

    `trainer_flags` go to every member (e.g. `--strategy=parameter_server`); the
    cluster must succeed.
    """
    model_dir = tmp_path / "model"
    cluster = [f"--workers={workers}"] + ([f"--ps={ps}"] if ps else [])
    launched(*cluster, "--", f"--model_dir={model_dir}", *trainer_flags, cwd=tmp_path)
    return json.loads((model_dir / "results.json").read_text())


def spawn(command: list[str], *, env: dict[str, str], **popen_args) -> subprocess.Popen:
    """`subprocess.Popen(command)` (text mode) in a session of its own, tagged for `kill`."""
    tag, env = _tagged(env)
    proc = subprocess.Popen(command, env=env, text=True, start_new_session=True, **popen_args)
    _started.append((tag, proc))
    return proc


def _tagged(env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """A new tag, and `env` with it added."""
    tag = f"{os.getpid()}.{next(_serial)}"
    return tag, {**env, TAG_VARIABLE: " ".join(filter(None, [env.get(TAG_VARIABLE), tag]))}


def kill(*procs: subprocess.Popen) -> None:
    """SIGKILLs each process of `procs` with its group and every process it started; reaps them."""
    if not procs:  # nothing to look for (each test's cleanup calls it: /proc is not read)
        return
    tags = {tag for tag, proc in _started if proc in procs}
    # A forked launcher's members (forked in turn, from the server forked with it) show the
    # tests' server's environment, not their tag: they are found as its descendants, before
    # it dies and they go to this process. (Not reaped yet: its pid is no other process's.)
    forked = {p.pid for p in procs if isinstance(p, forkserver.Forked) and p.returncode is None}
    below = descendants(forked)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
            os.killpg(proc.pid, signal.SIGKILL)
        if isinstance(proc, forkserver.Forked) and proc.returncode is None:
            # A forked command (not reaped, so the pid is its own) before its `setsid`.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
    # Descendants in sessions of their own (a launcher's members) are found by their tag;
    # again until none is left, as one may have started another meanwhile (bounded: a
    # process stuck in the kernel dies only when its I/O ends).
    deadline = time.monotonic() + 60
    signalled: set[int] = set()
    while (pids := tagged(tags) + [pid for pid in below if running(pid)]) and (
        time.monotonic() < deadline
    ):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        signalled.update(pids)
        time.sleep(0.01)
    # A process on its way out no longer shows its environment: wait until it is gone
    # (or a zombie), so that a caller never sees it still running.
    while [pid for pid in signalled if running(pid)] and time.monotonic() < deadline:
        time.sleep(0.01)
    # A forked command makes this process a child subreaper: the orphans it adopted, reaped.
    ours = {proc.pid for _, proc in _started} | {proc.pid for proc in procs}
    for pid in signalled - ours:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    for proc in procs:
        proc.wait()


def running(pid: int) -> bool:
    """Whether `pid` runs; a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _kill_when_it_ends(proc: subprocess.Popen) -> None:
    proc.wait()
    kill(proc)


def descendants(pids: set[int], parents: dict[int, int] | None = None) -> set[int]:
    """The live processes started by `pids`, their children's, and so on (by parent id).

    `parents`: each live process's parent (`parent_ids`), where the caller read them already.
    """
    children: dict[int, list[int]] = {}
    for pid, parent in (parent_ids() if parents is None else parents).items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def parent_ids() -> dict[int, int]:
    """Each live process's parent's id, by process id (from /proc)."""
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = pathlib.Path(entry.path, "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def tagged(tags: set[str]) -> list[int]:
    """The live processes whose environment carries one of `tags` (zombies have none)."""
    return [pid for pid, environ in environs() if tags & set(environ.get(TAG_VARIABLE, "").split())]


def environs() -> Iterator[tuple[int, dict[str, str]]]:
    """Each live process's id and environment (zombies and other users' have none)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = pathlib.Path(entry.path, "environ").read_bytes()
        except OSError:  # gone, a zombie, or another user's
            continue
        variables = (v.decode(errors="replace").partition("=") for v in environ.split(b"\0"))
        yield int(entry.name), {name: value for name, _, value in variables if name}


@contextlib.contextmanager
def killed_when_done() -> Iterator[None]:
    """Kills, on the way out, every process started here meanwhile and still running."""
    first = len(_started)
    try:
        yield
    finally:
        procs = [proc for _, proc in _started[first:]]
        kill(*procs)
        for proc in procs:  # the pipes a test left open
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        del _started[first:]


# Whatever ends the session (Ctrl-C included), nothing it started outlives it.
atexit.register(lambda: kill(*(proc for _, proc in _started)))


def checkpoint_values(model_dir) -> dict:
    """Every variable in the newest checkpoint of `model_dir`, by checkpoint key."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(str(model_dir), "checkpoints"))
    names = [n for n in reader.get_variable_to_shape_map() if "VARIABLE_VALUE" in n]
    return {n: reader.get_tensor(n) for n in names}


def pid_of(task_type: str, index: int, launcher: subprocess.Popen | _Signalled) -> int | None:
    """The live member `TYPE:INDEX` of the cluster `launcher` started, or None.

    Found among the launcher's descendants by its `TF_CONFIG`, or, forked, by its
    name (`towerflow.processes.member_identity`): the nearest to the launcher
    where a member's own children carry its name too.
    """
    parents, found = parent_ids(), set()
    for pid in descendants({launcher.pid}, parents):
        with contextlib.suppress(OSError):
            if member_identity(pid) == {"type": task_type, "index": index}:
                found.add(pid)
    return next((pid for pid in found if parents.get(pid) not in found), None)


def launch_and_signal(
    *args: str, cwd, trigger: str, member: tuple[str, int], sig: int, timeout: float = TIMEOUT_S
) -> tuple[int, list[tuple[float, str]], float]:
    """Runs `python -m trainer.launch ARGS`; at the first line holding `trigger`, signals `member`.

    The member is found among the launcher's descendants (`pid_of`).

    Returns:
      The launcher's exit code, its output as (seconds since start, line), and
      the second the signal was sent.
    """
    proc = start_cli(*args, cwd=cwd, module="trainer.launch")
    expired = threading.Event()

    def expire() -> None:  # the bound holds even while the cluster prints nothing
        expired.set()
        kill(proc)

    timer = threading.Timer(timeout, expire)
    timer.start()
    start, sent, lines = time.monotonic(), None, []
    try:
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))
            if sent is None and trigger in line:
                pid = pid_of(*member, proc)
                assert pid, f"{member} not found"
                os.kill(pid, sig)
                sent = time.monotonic() - start
        code = proc.wait()
    finally:
        timer.cancel()
        kill(proc)
    output = "\n".join(line for _, line in lines)[-3000:]
    assert not expired.is_set(), f"the cluster ran over {timeout} s:\n{output}"
    assert sent is not None, output
    return code, lines, sent


def tensorboard_scalars(model_dir, prefix: str, split: str = "train") -> dict:
    """`{tag: {step: value}}` of the scalars whose tag starts with `prefix` in a TensorBoard run."""
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(
        os.path.join(str(model_dir), split), size_guidance={event_accumulator.TENSORS: 0}
    )
    events.Reload()
    return {
        tag: {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}
        for tag in events.Tags()["tensors"]
        if tag.startswith(prefix)
    }

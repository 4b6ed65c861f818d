"""A real single-node Slurm for tests: munged, slurmctld and slurmd of its own, on 127.0.0.1.

`running()` starts a MUNGE daemon with its own key and socket, a controller
and a node daemon with their own `slurm.conf`, state, spool and logs, all in
one temporary directory, on free ports of 127.0.0.1; it waits until `sinfo`
shows the node idle, and at the end cancels every job, stops the daemons
(and whatever they started) and removes the directory, however the test
ended. The node is this machine under the name `localhost`, so every address
a job derives is on the loopback interface, and it offers `CPUS` CPUs
whatever the hardware has, so a 4-task job fits on a 2-core machine.

`unavailable()` says why it cannot run here (no Slurm or MUNGE binaries, not
root); Debian's `slurm-wlm` and `munge` packages provide them (`.ci/run`
installs them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

from tests import helpers
from towerflow.processes import pick_ports

NODE = "localhost"  # the node's Slurm name, and the host part of every derived address
CPUS = 4  # the CPUs the node offers (configured, not detected)
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel")
START_TIMEOUT_S = 120.0  # until the node shows idle; generous on a loaded machine
STOP_GRACE_S = 30.0  # for the daemons to end after SIGTERM
FINISHED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

_SLURM_CONF = """\
ClusterName=towerflow
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
# The daemons listen on 127.0.0.1 only, not on every interface.
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# No cgroups, accounting or MPI: tasks start without them, and a container may lack cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/linear
MailProg=/bin/true
ReturnToService=2
# The node offers the CPUs configured below, whatever the hardware has.
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@dataclasses.dataclass(frozen=True)
class Job:
    """A finished job: its state (`COMPLETED`, `FAILED`, ...), exit code and output file's text."""

    job_id: int
    state: str
    exit_code: str  # "status:signal", as scontrol shows it: "0:0" is success
    output: str


def unavailable() -> str | None:
    """Why a Slurm of its own cannot start here, or None when it can."""
    missing = [name for name in BINARIES if shutil.which(name) is None]
    if missing:
        return (
            f"no {', '.join(missing)} on PATH: install Debian's `slurm-wlm` and `munge` "
            "(`.ci/run` does)"
        )
    if os.geteuid() != 0:
        return "a Slurm of its own runs its daemons and jobs as root; run the tests as root"
    return None


class SlurmCluster:
    """A running single-node Slurm; `environ` is what its client commands need."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.environ = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
        self._daemons: list[subprocess.Popen] = []

    def command(self, *argv: str, timeout: float = 60.0) -> str:
        """Runs a Slurm client command (`sinfo`, `scontrol`, ...); its stdout.

        Raises:
          subprocess.CalledProcessError: it failed; the error carries its stderr.
        """
        return subprocess.run(
            argv, env=self.environ, capture_output=True, text=True, check=True, timeout=timeout
        ).stdout

    def submit(self, argv: Sequence[str], cwd: pathlib.Path, environ: dict[str, str]) -> int:
        """Runs an `sbatch` command line in `cwd` with `environ` (plus this Slurm's); the job id.

        `sbatch` passes its environment on to the job, so the job's processes carry the
        test's tag too: the test's end kills any that outlive it.
        """
        sbatch = helpers.spawn(
            list(argv),
            cwd=cwd,
            env={**environ, "SLURM_CONF": self.environ["SLURM_CONF"]},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        output, _ = sbatch.communicate(timeout=60)
        match = re.search(r"Submitted batch job (\d+)", output)
        assert match, f"{' '.join(argv)} did not submit: {output}"
        return int(match[1])

    def wait(self, job_id: int, timeout_s: float) -> Job:
        """Waits until the job ends; a job still running after `timeout_s` is cancelled.

        Raises:
          AssertionError: the job ran over `timeout_s` (its output is in the message).
        """
        deadline = time.monotonic() + timeout_s
        while (fields := self._job_fields(job_id))["JobState"] not in FINISHED_STATES:
            if time.monotonic() > deadline:
                self.command("scancel", str(job_id))
                raise AssertionError(
                    f"job {job_id} ran over {timeout_s:g} s and was cancelled; its output:\n"
                    + _tail(pathlib.Path(fields["StdOut"]))
                )
            time.sleep(1)
        return Job(job_id, fields["JobState"], fields["ExitCode"], _tail(fields["StdOut"], None))

    def logs(self) -> str:
        """The end of each daemon's log, for a failure's message."""
        return "\n".join(f"== {p.name}\n{_tail(p)}" for p in sorted(self.root.glob("log/*")))

    def _job_fields(self, job_id: int) -> dict[str, str]:
        shown = self.command("scontrol", "show", "job", "--oneliner", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def _start(self) -> None:
        """Starts munged, slurmctld and slurmd, then waits until the node is idle."""
        munge = self.root / "munge"
        key = os.open(munge / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(key, "wb") as f:  # readable by its owner only from the start, as munged wants
            f.write(secrets.token_bytes(1024))
        self._daemon(
            "munged",
            "--foreground",
            # munged refuses paths it finds too open (a TMPDIR without the sticky bit);
            # this key and socket serve one test run.
            "--force",
            f"--key-file={munge}/munge.key",
            f"--socket={munge}/munge.socket",
            f"--pid-file={munge}/munged.pid",
            f"--seed-file={munge}/munged.seed",
            f"--log-file={self.root}/log/munged.log",
        )
        self._daemon("slurmctld", "-D", "-i", "-f", self.environ["SLURM_CONF"])
        self._daemon("slurmd", "-D", "-N", NODE, "-f", self.environ["SLURM_CONF"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while (state := self._node_state()) != "idle":
            ended = [d.args[0] for d in self._daemons if d.poll() is not None]
            if ended or time.monotonic() > deadline:
                problem = f"{', '.join(ended)} ended" if ended else f"node state {state!r}"
                raise RuntimeError(
                    f"the test Slurm did not come up within {START_TIMEOUT_S:g} s ({problem}):\n"
                    + self.logs()
                )
            time.sleep(0.5)

    def _daemon(self, program: str, *args: str) -> None:
        with open(self.root / "log" / f"{program}.out", "w") as log:
            self._daemons.append(
                helpers.spawn(
                    [program, *args], env=self.environ, stdout=log, stderr=subprocess.STDOUT
                )
            )

    def _node_state(self) -> str | None:
        with contextlib.suppress(subprocess.SubprocessError):
            return self.command("sinfo", "--noheader", "--format=%t", f"--nodes={NODE}").strip()
        return None  # the controller does not answer yet

    def _stop(self) -> None:
        """Cancels every job, then stops the daemons and all they started."""
        if self._daemons and self._daemons[-1].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError):
                self.command("scancel", "--user=root", "--full")
        for daemon in reversed(self._daemons):  # slurmd, slurmctld, then munged
            with contextlib.suppress(ProcessLookupError):
                daemon.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(STOP_GRACE_S)
        # What a daemon left (a job step's slurmstepd and its tasks) carries its tag.
        helpers.kill(*self._daemons)


@contextlib.contextmanager
def running() -> Iterator[SlurmCluster]:
    """A single-node Slurm for the duration of the `with` block, stopped and removed after."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="towerflow-slurm-"))
    try:
        root.chmod(0o755)  # munged's socket must be reachable through it
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(mode=0o755)
        ctld_port, slurmd_port = pick_ports(2)
        (root / "slurm.conf").write_text(
            _SLURM_CONF.format(
                node=NODE, root=root, ctld_port=ctld_port, slurmd_port=slurmd_port, cpus=CPUS
            )
        )
        slurm = SlurmCluster(root)
        try:
            slurm._start()
            yield slurm
        finally:
            slurm._stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _tail(path: pathlib.Path | str, limit: int | None = 4000) -> str:
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError as e:
        return f"({e.strerror}: {path})"
    return text if limit is None else text[-limit:]

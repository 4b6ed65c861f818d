"""What a user sees when a run ends early: one-line errors and every exit status.

A `UserError` is a bad value the user can fix (a name, a size, a path, a
cluster description). Its message is one line that names the bad value, the
rule and the fix. The command line prints it without a traceback and exits
with status 2. A bug in the user's own code keeps its traceback.

Every exit status of towerflow's commands is defined here, and nowhere else;
schedulers retry 128-255 (a TFJob's `ExitCode` restart policy), so the
statuses that mean "restart me" are there. This module is part of the
shared core (`towerflow/`), below every layer that raises these errors
(`strategies/`, `trainer/`), and it imports nothing at all, so any module,
the light command-line tools included, may import it.
"""

USER_ERROR_EXIT_CODE = 2  # a bad config value, name, size or path: fix it and rerun
DIVERGED_EXIT_CODE = 3  # the loss blew up more than `train.max_recoveries` times
NO_SPACE_EXIT_CODE = 4  # a checkpoint did not fit on its file system
PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: saved at an agreed step; restart to resume
MEMBER_LOST_EXIT_CODE = 144  # another member of the cluster stopped answering; restart the cluster
# Elastic training: a member was lost, this one saved the step every survivor completed;
# start the group again at its new size (`cluster.elastic`) and it resumes from that step.
REFORM_EXIT_CODE = 145


class UserError(ValueError):
    """A mistake in the user's input, explained in one line."""


class MemberLost(Exception):
    """Another member of the cluster stopped answering (or never came up); restart the cluster."""

    exit_code = MEMBER_LOST_EXIT_CODE


class Reform(MemberLost):
    """Elastic training lost a member; this survivor saved its step: re-form the group."""

    exit_code = REFORM_EXIT_CODE


def one_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty)."""
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]

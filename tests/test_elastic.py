"""Elastic `multi_worker`: a group that loses a member goes on, and grows back when it returns."""

import json
import os
import re
import shlex
import signal

import numpy as np
import pytest
import tensorflow as tf

from strategies.cluster.roster import Roster
from tests.helpers import (
    REPO,
    assert_exit,
    checkpoint_values,
    cli_in_process,
    launch,
    launch_and_signal,
    launched,
    tensorboard_scalars,
    tiny_config,
)
from tests.steps_two_replicas import on_two_cpus
from tests.test_faults import signal_at
from towerflow.errors import UserError
from trainer import data
from trainer.launch import parse_workers
from trainer.loop import checks, elastic, optim, steps, train
from trainer.loop.checkpoints import Checkpointer

DOC = os.path.join(REPO, "docs", "elastic.md")
# Short blocks, no dropout (random draws in a failed step's forward pass are not kept), no
# eval or export; a lost member returns after 1 s.
FAST = [
    f"--config.{field}={value}"
    for field, value in {
        "train.steps_per_loop": 10,
        "eval.every": 0,
        "train.export": False,
        "model.dropout": 0,
        "cluster.elastic.cooldown_s": 1,
    }.items()
]


def _documented(model_dir, run: str = "runs/elastic") -> list[str]:
    """The launcher flags of docs/elastic.md's command into `run`, `model_dir` instead."""
    blocks = re.findall(r"```sh\n(.*?)```", open(DOC).read(), re.S)
    block = next(b for b in blocks if f"--model_dir={run} " in b)
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:3] == ["python", "-m", "trainer.launch"], words
    return [w.replace(run, str(model_dir)) for w in words[3:]]


def _killed_at_60(tmp_path, worker: int, sig: int = signal.SIGKILL) -> str:
    """The docs' command, made short, into `tmp_path/elastic`; `sig` to `worker` at step 60.

    Returns the launcher's output; the job must have ended well.
    """
    code, lines, _ = launch_and_signal(
        *_documented(tmp_path / "elastic"),
        *FAST,
        cwd=tmp_path,
        trigger="[member:0] train | step: 60/",
        member=("worker", worker),
        sig=sig,
    )
    output = "\n".join(line for _, line in lines)
    assert code == 0, output[-3000:]
    return output


# Loop actions (`train.actions`) of the members: worker:2 (worker:1) of the group SIGKILLs
# itself once step 30 (20) is trained. A real kill, at a block's end; the launcher forked
# from the tests' server (TensorFlow imported once for all its members) as `launched` runs it.
worker_2_killed_at_30 = signal_at(30, signal.SIGKILL, worker=2)
worker_1_killed_at_20 = signal_at(20, signal.SIGKILL, worker=1)
# The default tier's runs, shorter than the docs' 200 steps of a smaller model (a step's
# all-reduce is most of its cost), training only (what they assert is in the checkpoints,
# results.json and the train events): the group of 3 trains 3 blocks before the loss; the
# group of 2 trains a block or more before the member returns (at a block boundary, about
# step 60: 6 blocks before the end), and the group of 3 trains the rest.
REJOIN_STEPS = 120
SMALL = ["--mode=train", "--config.model.hidden_units=(32,)"]
SHRINK_STEPS = 50  # the per-replica run: 2 blocks of 2 members, then 3 of 1


def _launched_killing(*args: str, action: str, cwd) -> str:
    """`launched(ARGS)` with the loop action `action` of this module; what it printed."""
    result = launched(*args, f"--config.train.actions=tests.test_elastic:{action}", cwd=cwd)
    return result.stdout + result.stderr


def test_a_lost_member_is_saved_around_and_rejoins_ending_where_an_uninterrupted_run_does(
    tmp_path, capsys
):
    documented = _documented(tmp_path / "elastic")
    short = f"--config.train.steps={REJOIN_STEPS}"
    output = _launched_killing(
        *documented, *FAST, *SMALL, short, action="worker_2_killed_at_30", cwd=tmp_path
    )
    # The survivors saved the step they completed; the group of 2 restored exactly it.
    saved = {int(s) for s in re.findall(r"elastic: .* saved step (\d+) to", output)}
    # Survivors save the last step they completed; one may have completed one more than
    # another (docs/elastic.md): the newest save is the one restored.
    assert saved and max(saved) - min(saved) <= 1, output[-3000:]
    step = max(saved)
    assert step >= 30 and f"/elastic/ckpt-{step}-worker" in output
    restored = [int(s) for s in re.findall(r"\[member:0\] restored \S+ at step (\d+)", output)]
    grown = int(re.search(r"preempted \(SIGTERM.*? at step (\d+)", output).group(1))
    assert restored == [step, grown], output[-3000:]  # 0 steps lost, 0 steps trained twice
    assert "[launch] group of 2: member:0 as worker:0, member:1 as worker:1" in output
    assert "member:2 ready again" in output
    assert "members: 2 | replicas: 2 | per_replica_batch: 24" in output  # the group went on
    results = json.loads((tmp_path / "elastic" / "results.json").read_text())
    assert results["step"] == REJOIN_STEPS
    reforms = results["elastic"]["reforms"]
    assert [(r["step"], r["from"], r["to"]) for r in reforms] == [(step, 3, 2), (grown, 2, 3)]
    assert all(0 < r["seconds"] < 120 for r in reforms)
    members = tensorboard_scalars(tmp_path / "elastic", "members")["members"]
    assert {members[s] for s in members if s <= step} == {3}
    assert 2 in {members[s] for s in members if step < s <= grown}
    # Same seed, the same global batch of the same examples at every step, whatever the
    # group's size: the weights of an uninterrupted run, within float summation order (a
    # batch trained twice or skipped is far beyond). The uninterrupted run is the docs'
    # command on one device, in this process: a group of any size trains its trajectory.
    trainer_flags = _documented(tmp_path / "fixed")
    trainer_flags = trainer_flags[trainer_flags.index("--") + 1 :]
    one_device = [w.replace("=multi_worker", "=one_device") for w in trainer_flags]
    code, _, err = cli_in_process(*one_device, *FAST, *SMALL, short, capsys=capsys)
    assert code == 0, err[-3000:]
    got, want = checkpoint_values(tmp_path / "elastic"), checkpoint_values(tmp_path / "fixed")
    assert got.keys() == want.keys()
    for name in want:
        # A hidden unit near ReLU's kink may move by 1e-4 under another summation order; a
        # batch trained twice or skipped moves most weights by far more.
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=2e-4, err_msg=name)
        close = np.isclose(got[name], want[name], rtol=1e-4, atol=1e-5)
        assert close.mean() > 0.999, (name, close.mean())


@pytest.mark.slow  # a second kill-and-rejoin run; the default tier's test above loses a worker
def test_a_lost_chief_is_a_membership_change_like_any_other(tmp_path):
    output = _killed_at_60(tmp_path, worker=0)
    step = max(int(s) for s in re.findall(r"elastic: .* saved step (\d+) to", output))  # newest
    assert "[launch] group of 2: member:1 as worker:0, member:2 as worker:1" in output
    assert f"[member:1] restored {tmp_path / 'elastic'}/elastic/ckpt-{step}-" in output
    assert re.search(r"\[member:1\] train \| step: .* members: 2", output)  # the new chief
    results = json.loads((tmp_path / "elastic" / "results.json").read_text())
    assert results["step"] == 200
    assert [(r["step"], r["from"], r["to"]) for r in results["elastic"]["reforms"]][0] == (
        step,
        3,
        2,
    )


@pytest.mark.slow  # a hung member is found by heartbeats (about 10 s), then a rejoin
def test_a_hung_member_is_left_behind_and_rejoins_once_restarted(tmp_path):
    output = _killed_at_60(tmp_path, worker=2, sig=signal.SIGSTOP)
    assert re.search(r"\[member:0\] elastic: worker:2 .* saved step \d+ to", output)
    assert "[launch] member:2 lost: back in 1 s" in output
    assert "[launch] group of 2: member:0 as worker:0, member:1 as worker:1" in output
    results = json.loads((tmp_path / "elastic" / "results.json").read_text())
    assert results["step"] == 200
    assert [(r["from"], r["to"]) for r in results["elastic"]["reforms"]] == [(3, 2), (2, 3)]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--workers=4:2", "--", "--strategy=multi_worker"], "`--workers` (4:2) must be MIN:MAX"),
        (["--workers=2:x", "--", "--strategy=multi_worker"], "`--workers` ('2:x') must be"),
        (["--workers=2:3", "--ps=1", "--"], "drop `--ps`"),
        (["--workers=1:2", "--", "--strategy=mirrored"], "needs `--strategy=multi_worker`"),
    ],
)
def test_bad_elastic_launches_are_one_line_and_exit_2(tmp_path, args, expected):
    result = launch(*args[:-1], args[-1], f"--model_dir={tmp_path / 'run'}", cwd=tmp_path)
    errors = [line for line in result.stdout.splitlines() + result.stderr.splitlines()]
    errors = [line for line in errors if "error:" in line]
    assert_exit(result, 2)
    assert errors and expected in errors[0], errors
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("cluster.elastic.min_workers=0", "`cluster.elastic.min_workers` (0) must be at least 1"),
        ("cluster.elastic.batch=fixed", "`cluster.elastic.batch` 'fixed' must be one of global"),
    ],
)
def test_a_bad_elastic_field_is_one_line_and_exit_2(tmp_path, flag, expected, capsys):
    # In-process: tests/test_cli.py runs the command's one-line exits in a process.
    code, _, err = cli_in_process(
        "--strategy=multi_worker",
        f"--model_dir={tmp_path / 'run'}",
        f"--config.{flag}",
        capsys=capsys,
    )
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert expected in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"cluster.elastic.max_workers": 2, "strategy.name": "pipeline"}, "`pipeline` cannot"),
        ({"cluster.elastic.max_workers": 2, "strategy.name": "mirrored"}, "`mirrored` cannot"),
        (
            {"cluster.elastic.min_workers": 3, "cluster.elastic.max_workers": 2},
            "`cluster.elastic.max_workers` (2) must be 0 (not elastic) or at least",
        ),
        ({"cluster.elastic.rendezvous_timeout": -1.0}, "`cluster.elastic.rendezvous_timeout`"),
        ({"cluster.elastic.batch": "examples"}, "`cluster.elastic.batch` 'examples' must be"),
        ({"cluster.elastic.lr_scaling": "sqrt"}, "'sqrt' must be one of linear, none or"),
        (
            {
                "cluster.elastic.max_workers": 2,
                "cluster.elastic.batch": "per_replica",
                "train.epochs": 1,
            },
            "`train.epochs` (1) would give each group size",
        ),
    ],
)
def test_bad_elastic_settings_are_refused_before_anything_is_built(fields, expected):
    config = tiny_config(**{"strategy.name": "multi_worker", **fields})
    with pytest.raises(UserError, match=re.escape(expected)):
        checks.check_config(config)


def test_workers_is_a_count_or_a_range():
    assert parse_workers("3") == (3, 3, False)
    assert parse_workers("2:4") == (2, 4, True)
    with pytest.raises(UserError, match="1 <= MIN <= MAX"):
        parse_workers("0:2")


def test_a_failing_member_cools_down_longer_each_time_then_stays_out():
    now = [0.0]
    roster = Roster(2, 3, max_restarts=2, cooldown_s=5, rendezvous_timeout=0, clock=lambda: now[0])
    assert roster.lost("member:1") == "back in 5 s (failure 1 of 3)"
    assert roster.ready() == ["member:0", "member:2"]
    now[0] = 5.0
    assert roster.ready() == ["member:0", "member:1", "member:2"]
    assert roster.lost("member:1") == "back in 10 s (failure 2 of 3)"
    now[0] = 15.0
    assert "member:1" in roster.ready()
    assert "out for good" in roster.lost("member:1")
    now[0] = 1e9
    assert roster.ready() == ["member:0", "member:2"]
    assert roster.missing() == ["member:1 (failed 3 times)"]


def test_below_min_workers_the_group_does_not_form_and_the_missing_are_named():
    roster = Roster(2, 2, max_restarts=0, cooldown_s=5, rendezvous_timeout=0.3)
    roster.lost("member:1")
    assert roster.form() is None
    assert roster.missing() == ["member:1 (failed 1 times)"]
    assert Roster(1, 2, 0, 5, 0.3).form() == ["member:0", "member:1"]


@pytest.mark.parametrize(
    "batch, replicas, fitted",
    [(48, 3, 48), (32, 3, 33), (50, 4, 52), (10, 4, 12), (9, 4, 8)],
)
def test_a_global_batch_that_does_not_split_becomes_the_nearest_that_does(batch, replicas, fitted):
    said = []
    assert elastic.fit_batches(batch, batch, replicas, 1, said.append) == (fitted, fitted)
    assert len(said) == (0 if fitted == batch else 2)
    if said:
        assert f"({batch}) does not split over {replicas} replicas: using {fitted}" in said[0]


def test_the_counted_step_counts_each_step_once_over_the_replicas_of_a_process(tmp_path):
    config = tiny_config(**on_two_cpus("mirrored"))  # 2 replicas in this process
    job = train.build(config, str(tmp_path / "run"))
    gb = config.train.global_batch_size
    step = steps.TrainStep(job.model, job.optimizer, job.objective, gb)
    counted = elastic.CountedStep(step, 7, len(job.strategy.tf_strategy.extended.worker_devices))
    iterator = iter(job.strategy.distribute_dataset(job.dataset.train_fn(gb, config.seed, 0)))
    job.strategy.run_steps(counted, iterator, 3)
    assert job.strategy.num_replicas_in_sync == 2
    assert counted.completed == 7 + 3 == 7 + int(counted.iterations.numpy())


def test_a_rerun_resumes_from_a_survivors_save_newer_than_the_newest_checkpoint(tmp_path):
    job = train.build(tiny_config(**{"strategy.name": "one_device"}), str(tmp_path / "run"))
    checkpointer = Checkpointer(str(tmp_path / "run"), True, 3, **train.checkpointed(job))
    checkpointer.save(0)
    job.optimizer.iterations.assign(12)
    elastic.survivor_save(checkpointer.checkpoint, str(tmp_path / "run"), 12, "worker:1")
    job.optimizer.iterations.assign(0)
    assert elastic.newest_save(str(tmp_path / "run"))[0] == 12
    assert elastic.restore(checkpointer, str(tmp_path / "run")).endswith("ckpt-12-worker1")
    assert int(job.optimizer.iterations.numpy()) == 12
    checkpointer.save(20)  # a newer checkpoint wins over the save
    assert elastic.restore(checkpointer, str(tmp_path / "run")).endswith("checkpoints/ckpt-20")


def sqrt_scaling(global_batch, reference_lr, reference_batch):
    """A user's rule (`cluster.elastic.lr_scaling`), its parameters in an order of its own."""
    return reference_lr * (global_batch / reference_batch) ** 0.5


def test_the_learning_rate_rule_is_linear_none_or_the_users_function():
    assert elastic.lr_rule("linear")(0.3, 48, 32) == pytest.approx(0.2)
    assert elastic.lr_rule("none")(0.3, 48, 32) == 0.3
    assert elastic.lr_rule("tests.test_elastic:sqrt_scaling")(0.3, 48, 12) == pytest.approx(0.15)
    with pytest.raises(UserError, match="`cluster.elastic.lr_scaling` 'no_rules:f': no module"):
        elastic.lr_rule("no_rules:f")


def _per_replica(batch: int, max_workers: int = 3, **fields):
    return tiny_config(
        **{
            "strategy.name": "multi_worker",
            "cluster.elastic.max_workers": max_workers,
            "cluster.elastic.batch": "per_replica",
            "train.global_batch_size": batch,
            "optimizer.learning_rate": 0.003,
            **fields,
        }
    )


@pytest.mark.parametrize(
    "batch, replicas, workers, rule, global_batch, rate",
    [
        (48, 2, 2, "linear", 32, 0.002),  # 16 per replica, as in the full group of 3
        (48, 3, 3, "linear", 48, 0.003),  # the full group: the config as written
        (48, 4, 2, "none", 32, 0.003),  # 2 replicas a member: 48 over 6, 8 each
        (49, 2, 2, "linear", 32, 0.002),  # 49 does not split over 3: the full group's is 48
        (48, 1, 1, "tests.test_elastic:sqrt_scaling", 16, 0.003 * (1 / 3) ** 0.5),
    ],
)
def test_per_replica_keeps_the_full_groups_per_replica_batch_and_scales_the_rate(
    batch, replicas, workers, rule, global_batch, rate
):
    config = _per_replica(batch, **{"cluster.elastic.lr_scaling": rule})
    said = []
    batches = elastic.group_batches(config, replicas, workers, said.append)
    assert batches.train == global_batch and batches.learning_rate == pytest.approx(rate)
    assert config.train.global_batch_size == batch, "the config as written stays"
    group = elastic.for_group(config, batches)
    assert group.train.global_batch_size == global_batch
    assert group.optimizer.learning_rate == batches.learning_rate
    training = [line for line in said if "`eval.global_batch_size`" not in line]
    assert training[-1].startswith(f"elastic: per-replica batch {global_batch // replicas} kept")
    assert len(training) == (2 if batch == 49 else 1)


def no_rate(reference_lr, reference_batch, global_batch):
    """A user's rule that forgot to return the rate."""


def test_a_users_rate_that_is_not_a_positive_number_is_one_line():
    config = _per_replica(48, **{"cluster.elastic.lr_scaling": "tests.test_elastic:no_rate"})
    with pytest.raises(UserError, match="gave None for a global batch of 16; it must return"):
        elastic.keep_per_replica_batch(config, 1, 1, print)


def test_the_stream_goes_on_at_the_next_example_when_the_group_shrinks_and_grows():
    """3 replicas for 5 steps, 2 for 4, 3 for 2: exactly the stream one replica reads alone."""
    dataset = data.get(tiny_config().data)
    position, each, seen, step = elastic.InputPosition(), 4, [], 0
    for replicas, steps_trained in ((3, 5), (2, 4), (3, 2)):  # a group, a worker a replica
        first = position.start(step, replicas)
        stream = dataset.train_fn(each * replicas, 0, step, start_batch=first)
        pipelines = [
            iter(stream(tf.distribute.InputContext(replicas, p, replicas))) for p in range(replicas)
        ]
        seen += [next(pipe)[0].numpy() for _ in range(steps_trained) for pipe in pipelines]
        step += steps_trained
    alone = dataset.train_fn(each, 0)(tf.distribute.InputContext())
    expected = [x.numpy() for x, _ in alone.take(len(seen))]
    assert len(seen) == 3 * 5 + 2 * 4 + 3 * 2
    for got, want in zip(seen, expected, strict=True):
        np.testing.assert_array_equal(got, want)  # 0 batches repeated, 0 skipped


def test_a_per_replica_group_that_shrinks_keeps_each_replicas_batch_and_scales_the_rate(
    tmp_path,
):
    """The docs' `per_replica` command, 2 members (24 a replica, 48 a step), loses one for good.

    2 members, not the docs' 3: what is asserted is the full group's per-replica batch kept
    by the smaller group, whatever the sizes (the docs' numbers for 3 members: the
    in-process test of `group_batches` above).
    """
    out = "--config.cluster.elastic.max_restarts=0"  # the lost member stays out
    short = [f"--config.train.steps={SHRINK_STEPS}", "--config.optimizer.learning_rate=0.003"]
    documented = _documented(tmp_path / "elastic", "runs/per_replica")
    assert "--workers=2:3" in documented
    documented[documented.index("--workers=2:3")] = "--workers=1:2"
    output = _launched_killing(
        *documented, *FAST, *SMALL, out, *short, action="worker_1_killed_at_20", cwd=tmp_path
    )
    step = max(int(s) for s in re.findall(r"elastic: .* saved step (\d+) to", output))  # newest
    assert f"[member:0] restored {tmp_path / 'elastic'}/elastic/ckpt-{step}-" in output  # 0 lost
    assert "members: 2 | replicas: 2 | per_replica_batch: 24 | global_batch: 48" in output
    assert "members: 1 | replicas: 1 | per_replica_batch: 24 | global_batch: 24" in output
    assert "[member:0] elastic: per-replica batch 24 kept on 1 replicas: global batch 24" in output
    results = json.loads((tmp_path / "elastic" / "results.json").read_text())
    assert results["step"] == SHRINK_STEPS
    group = results["elastic"]
    assert (group["batch"], group["global_batch"]) == ("per_replica", 24)
    assert group["learning_rate"] == pytest.approx(0.0015)  # 0.003 x 24 / 48
    reforms = [(r["step"], r["from"], r["to"], r["global_batch"]) for r in group["reforms"]]
    assert reforms == [(step, 2, 1, 24)]
    assert group["reforms"][0]["learning_rate"] == pytest.approx(0.0015)
    # The rate in use, as TensorBoard shows it: the schedule's at 0.003 before, at 0.0015 after.
    rates = tensorboard_scalars(tmp_path / "elastic", "learning_rate")["learning_rate"]
    schedule = tiny_config(**{"optimizer.learning_rate": 1.0}).optimizer
    unit = optim.build(schedule, SHRINK_STEPS)
    for at, rate in rates.items():
        unit.iterations.assign(at)
        peak = 0.003 if at <= step else 0.0015
        assert rate == pytest.approx(peak * float(unit.learning_rate), rel=1e-5), at
    # The input position: 2 per-replica batches a step up to the loss, then 1 from there on
    # (the stream goes on at the next batch: the in-process test above), counted exactly.
    position = {
        name.split("/")[1]: int(value)
        for name, value in checkpoint_values(tmp_path / "elastic").items()
        if name.startswith("elastic_input/")
    }
    assert position == {"batches": 2 * step, "step": step, "replicas": 1}, position


def test_a_run_resumed_with_the_other_batch_choice_is_refused_in_one_line(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(tiny_config().to_json())  # not elastic: 'global'
    config = _per_replica(48)
    with pytest.raises(UserError, match="trained with `cluster.elastic.batch` 'global'"):
        elastic.check_batch_kept(config, str(model_dir))
    (model_dir / "config.json").write_text(config.to_json())
    elastic.check_batch_kept(config, str(model_dir))  # the same choice resumes

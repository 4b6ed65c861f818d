"""The watchdog ends a loop that waits on a member which stopped answering."""

import itertools
import threading

from towerflow import errors
from trainer.loop import faults


def test_a_member_silent_for_the_bound_makes_the_watchdog_give_up():
    given_up = []
    done = threading.Event()

    def give_up(lost, seconds):
        given_up.append((lost, seconds))
        done.set()

    probe = lambda: ["worker:0 (127.0.0.1:9)"]  # noqa: E731
    reports = []
    watchdog = faults.Watchdog(probe, reports.append, after_s=0.05, give_up_s=0.3, give_up=give_up)
    with watchdog, watchdog.loop(100):
        assert done.wait(timeout=60), reports
    ((lost, seconds),) = given_up
    assert lost == ["worker:0 (127.0.0.1:9)"] and seconds >= 0.3
    assert len(reports) >= 2 and all("not answering: worker:0" in r for r in reports)


def test_a_member_that_answers_again_restarts_the_count():
    answers = itertools.cycle([["worker:1 (h:1)"], [], ["worker:1 (h:1)"], []])
    probes = itertools.count(1)
    probed_enough = threading.Event()  # well past `give_up_s` of silences, had they added up

    def probe():
        if next(probes) >= 40:
            probed_enough.set()
        return next(answers)

    given_up = []
    watchdog = faults.Watchdog(
        probe,
        lambda _: None,
        after_s=0.02,
        give_up_s=0.1,
        give_up=lambda lost, s: given_up.append(lost),
    )
    with watchdog, watchdog.loop(0):
        assert probed_enough.wait(timeout=60), "the watchdog did not probe"
    assert given_up == []


def test_the_message_names_the_member_and_how_to_resume(capfd, monkeypatch):
    codes = []
    monkeypatch.setattr(faults.os, "_exit", codes.append)
    faults.exit_member_lost(["chief (127.0.0.1:5)"], 21.4)
    err = capfd.readouterr().err
    assert codes == [errors.MEMBER_LOST_EXIT_CODE]
    assert err.startswith("error: chief (127.0.0.1:5) stopped answering (no reply to the ")
    assert "for 21 s" in err and "--restarts=N" in err and err.count("\n") == 1

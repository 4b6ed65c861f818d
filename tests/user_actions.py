"""A user's own loop actions, named in `train.actions` by the tests."""

from trainer.loop import actions

SEEN: list[tuple[int, dict]] = []


def stop_at_10(config):
    """Stops training once step 10 is reached; records what every block reported."""

    def act(output: actions.Output) -> None:
        SEEN.append((output.step, dict(output.metrics)))
        if output.step >= 10:
            raise actions.StopTraining("reached step 10")

    return act


def every_4_steps(config):
    """An action with its own schedule."""
    return actions.Action(lambda output: SEEN.append((output.step, {})), every=4)

"""The training loop: the job, the controller and its actions, the step, checkpoints."""

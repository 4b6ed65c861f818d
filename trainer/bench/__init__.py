"""`python -m trainer.bench`: how fast towerflow trains, next to Keras `fit` and a bare loop.

    python -m trainer.bench                        # every case at full size (~20-30 min, 2 cores)
    python -m trainer.bench --quick                # every case, tiny sizes: a smoke test
    python -m trainer.bench --cases=small_mlp,input --json=bench.json

Contenders (`contenders.py`) train the same model on the same data, global
batch and strategy:

- `towerflow`: `trainer.loop.train.run` as a user runs it (default config values,
  including `train.steps_per_loop`), timed over whole loops by a clock action
  (`clock.py`) that notes when each block and its actions are done, so each
  loop's summaries, metrics and progress line count. Checkpoints and evals are
  off here (the `checkpoint` case measures saves; the end-of-run checkpoint
  comes after one more, untimed step).
- `keras_fit_spe<k>`: Keras `model.fit` under the same `tf.distribute` strategy,
  with `steps_per_execution` 1 and the `steps_per_loop` towerflow uses, and
  Keras's own optimizer class (same kind, schedule and results; towerflow's
  runs each variable's update as one fused kernel).
- `bare_loop`: the floor: `strategy.run` of a minimal step in a `tf.range`
  loop inside one `tf.function`, with towerflow's optimizer; nothing else.
  Like the others it starts a new input pipeline each repetition.

Each case runs in its own process, set up as the trainer sets up the case's
strategy (threads per op: see `devices.intra_op_threads`); every contender
of the case runs with that setup (`harness.py`).

Every contender warms up once (tracing, pipeline start; towerflow, Keras
and the bare loop instead leave their first loop out of every timing), then
all run in turn `--reps` times, each round starting one later and every
other one backwards (A B C, A C B, C A B, ...), so load from other processes
hits them alike and none always runs after the same other one; what one left
for the collector is collected before the next starts. Figures are medians;
ratios are medians of the ratios within each round (paired), which load that
comes and goes disturbs less. Cases, one module each, named after the case:

1. `small_mlp`: an overhead-bound MLP (~300k parameters), examples/s.
2. `dense_large`: a compute-bound MLP (~15M parameters, batch 512) under
   `one_device`: model FLOP/s (6 x parameters x examples/s) over the float32
   matmul peak measured alongside (utilisation); also under `mixed_bfloat16`.
3. `input`: the synthetic and TFRecord pipelines alone (examples/s) against
   what training on them consumes, and the time a step waits for its batch.
4. `strategies`: `small_mlp` under one_device, mirrored and central_storage (2
   logical CPUs), and as local clusters (`trainer.launch`) under multi_worker
   and parameter_server, relative to one_device.
5. `startup`: seconds from process start to the first finished step of
   `python -m trainer`, next to `import tensorflow` alone and to the floor
   (import, build a model, compile and run one step).
6. `checkpoint`: how long a save of a ~100 MB checkpoint blocks training,
   synchronous against asynchronous, and how long a restore takes.
7. `multi_host`: `multi_worker` on 2 simulated hosts (network namespaces, one
   core each) over raw and shaped links, against one host alone (needs root;
   `hosts.py` makes the hosts).
8. `gradients`: `multi_worker` on 2 local workers (one core each) on the
   `dense_large` MLP: float32 against bfloat16 gradient transfer, one pack
   against 16 MB packs, gradient accumulation; examples/s, scaling efficiency
   over one worker alone, all-reduce times (`allreduce.py`) and digits accuracy.
9. `stragglers`: `parameter_server` on 3 local workers, one of them slow:
   spare replicas (k = 2 of 3 against 3: seconds per step, accuracy) and
   asynchronous staleness (its histogram; `scale` against `none`: steps to
   the synchronous accuracy).
10. `data_service`: the small MLP with its input in the trainer against its input on the
   tf.data service (a dispatcher and a data worker, `data.service`), the
   trainer on one core and the data worker on another: compute-bound
   (synthetic data; the service's overhead) and input-bound (a pipeline of busy
   work per batch); examples/s and the ratios beside the targets (1.6 and 0.95).
   Also the CPU seconds per trial of the data workers of a 2-trial sweep
   with `--share_input` against without (target about half), and the
   default job reading from servers on another simulated host against the
   same servers on its own (needs root).
11. `tables`: dynamic embedding tables on the ctr job (`configs/ctr.py`):
   `parameter_server` step time (2 workers, 2 ps) of a `DynamicEmbedding`
   against a hashed `ShardedEmbedding` of as many rows; `mirrored` sparse
   against dense updates (`optimizer.sparse_updates`); eval AUC of a dynamic
   table admitting ids seen twice against a hashed one of as many rows; 10M
   ids over 2 ps members (bytes per id, lookups/s per member); incremental
   checkpoints reported as not built.
12. `elastic`: an elastic `multi_worker` job (`trainer.launch --workers=2:3`) on
   digits losing a member (SIGKILL): seconds from the loss to the next completed
   step of the group of 2 (detection, save, re-form, first step; target <= 15 s),
   steps lost and examples repeated (target 0), and the shrunk group's steps/s
   against a fresh 2-worker job (target >= 0.95).
13. `tables_quality`: on a drifting Zipf(1.1) stream of raw ids, eval AUC of a
   hashed table against a `DynamicEmbedding` fitted into the same bytes, at
   5%, 15%, 50% and 100% of the distinct ids as rows; at 15% the dynamic
   policy one change at a time (LRU, `min_count` 1, no fallback rows).
"""

from trainer.bench.sizes import CASES, FULL, QUICK, SINGLE_PROCESS, Sizes

__all__ = ["CASES", "FULL", "QUICK", "SINGLE_PROCESS", "Sizes"]

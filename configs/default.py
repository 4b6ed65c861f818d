"""The default job: an MLP on the bundled UCI handwritten digits.

    python -m trainer --strategy=mirrored

Trains 1,000 steps at a global batch of 128 (about 90 epochs of the 1,437
training images) and reaches 0.97-0.98 eval accuracy on the 360 held-out
images in well under a minute on 2 CPU cores. Every field below can be
overridden, e.g. `--config.train.steps=3000`; a mistyped field is an error.
"""

import ml_collections

import strategies.options as strategy_options
import trainer.loop.options as loop_options


def _declared(component: str) -> ml_collections.ConfigDict:
    """The fields of a built-in component at their defaults, declared in trainer/loop/options.py."""
    return loop_options.BUILTIN[component].defaults()


def get_config() -> ml_collections.ConfigDict:
    """Returns the default config; other configs start from it."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds model init, data shuffling and dropout

    # Each built-in plugin's options live under its own name, so `--strategy` swaps among them;
    # their defaults and meanings are declared once, in strategies/options.py.
    c.strategy = ml_collections.ConfigDict()
    c.strategy.name = "mirrored"  # a registered plugin: `python -m trainer --list_strategies`
    c.strategy.update(strategy_options.sections())

    # Where this process's cluster comes from (strategies/cluster/discovery.py); `--cluster` sets
    # `source`. auto: `TF_CONFIG` if set, else a Slurm step or a JobSet or SageMaker job of
    # several processes, else one process | tf_config | slurm | jobset | sagemaker | local.
    c.cluster = ml_collections.ConfigDict()
    c.cluster.source = "auto"
    # slurm / jobset / sagemaker: every member's port (slurm: +1 for each next member on a node).
    c.cluster.port = 2222
    c.cluster.ps_members = 1  # slurm, under parameter_server: members after the chief that are ps
    # The old name of `ps_members`, kept for one release: set, it is used with a warning.
    c.cluster.ps_tasks = ml_collections.config_dict.placeholder(int)
    # An evaluator member runs beside training though `TF_CONFIG` does not list it (e.g. Vertex
    # AI): the chief then leaves evaluation to it. One listed in `cluster` needs no flag.
    c.cluster.sidecar_evaluator = False
    # Elastic `multi_worker` (docs/elastic.md), declared in trainer/loop/options.py.
    c.cluster.elastic = _declared("elastic")

    # The devices this process trains on: logical CPUs, GPU memory, threads.
    c.devices = ml_collections.ConfigDict()
    c.devices.logical_cpus = 2  # split the host CPU into N logical devices (0 = leave as is)
    c.devices.gpu_memory_growth = True  # allocate GPU memory as needed, not all at start
    c.devices.gpu_memory_limit_mb = 0  # per-GPU memory cap for this process (0 = none)
    c.devices.log_placement = False  # log the device of every op (very verbose)
    # Threads one op may use. 0 = auto: with replicas on logical CPUs (no GPU), the
    # host's cores shared out among them, so towers compute side by side instead of
    # contending for every core (1.4x on small models here); else TensorFlow's default.
    c.devices.intra_op_threads = 0

    # What is trained: the loss and metrics, or your own `trainer.Task`.
    c.task = ml_collections.ConfigDict()
    # What is trained: auto (classification or regression, from the data's `num_classes`),
    # classification, regression, or your own task as "module.path:TaskClass" (see
    # trainer/loop/tasks.py `Task`), whose options your config file adds under `task`.
    c.task.name = "auto"

    # The model: a built-in builder and its sizes, or your own builder.
    c.model = ml_collections.ConfigDict()
    # A built-in builder (mlp | cnn | resnet) or your own as "module.path:function".
    c.model.name = "mlp"
    c.model.hidden_units = (256, 256)  # mlp: width of each hidden layer
    c.model.filters = 32  # cnn / resnet: channels of the first convolution
    c.model.blocks = 2  # resnet: residual blocks per stage
    c.model.dropout = 0.1  # dropout rate before the output layer
    c.model.weight_decay = 0.0  # L2 penalty on kernels, added to the loss

    # The input: a built-in source or your own pipeline, how workers split it, where it runs.
    c.data = ml_collections.ConfigDict()
    # A built-in source (digits | synthetic | ctr | tfrecord | csv), or your own input
    # pipeline as "module.path:function": fn(input_context, split, global_batch_size)
    # -> tf.data.Dataset of (features, labels[, sample_weights]) batches, split "train" or
    # "eval"; resumed by skipping the batches already trained on (see trainer/data/user.py).
    c.data.name = "digits"
    c.data.shuffle_buffer = 10_000  # examples held for shuffling the training stream
    # How workers' input pipelines split the data: auto | file | data | off
    # (digits / synthetic / ctr are split by example under auto, file and data).
    c.data.sharding = "auto"
    # Where the training input runs (trainer/data/service_client.py): "" = in the trainer's process;
    # "local:N" = TensorFlow's tf.data service on a dispatcher and N data workers started
    # beside the trainer; "grpc://host:port" = a dispatcher elsewhere (`python -m
    # trainer.data_service`). Evaluation always reads in the trainer (exactly once).
    c.data.service = ""
    # How data workers share the stream: auto | off (parallel_epochs: one worker runs each
    # trainer pipeline whole; exact order, exactly-once, exact resume) | dynamic
    # (distributed_epoch: the dispatcher hands out the source's elements to the workers;
    # at-most-once if one dies). auto = off, or dynamic under parameter_server.
    c.data.service_sharding = "auto"
    # local:N: the trainer and its servers run in a network namespace of their own with only
    # loopback (TensorFlow's servers listen on every interface); True = on this host's network,
    # reachable from other hosts (needed for a remote model_dir with local:N).
    c.data.service_allow_network = False
    c.data.service_timeout_s = 60.0  # seconds for the dispatcher and a worker to answer at start
    # Trainers naming the same job with identical pipelines read one stream, each every batch
    # (a sweep's `--share_input`); "" = each its own.
    c.data.service_job = ""
    # tf.data's autotuning model (off: AUTOTUNE maps use every core; on, a long-lived pipeline
    # may take up to a minute to delete, docs/troubleshooting.md); a RAM budget turns it on.
    c.data.autotune = False
    c.data.autotune_ram_budget_mb = 0  # tf.data autotuning memory budget, MiB (0 = half the RAM)
    c.data.eval_fraction = 0.2  # digits / synthetic / ctr: share of examples held out for eval
    # synthetic: a deterministic, learnable problem of any size.
    c.data.synthetic = ml_collections.ConfigDict()
    c.data.synthetic.num_examples = 4096  # total examples (train + eval)
    c.data.synthetic.input_shape = (32,)  # shape of one example
    c.data.synthetic.num_classes = 10  # 0 = regression
    c.data.synthetic.noise = 0.1  # label noise (std of the logits' perturbation)
    # ctr: synthetic click-through logs, categorical ids in, click (1) or not (0) out.
    c.data.ctr = ml_collections.ConfigDict()
    c.data.ctr.num_examples = 1_000_000  # total examples (train + eval)
    c.data.ctr.num_fields = 8  # categorical fields per example
    c.data.ctr.ids_per_field = 3_000  # values a field takes; frequency falls as 1/rank
    c.data.ctr.vocab_size = 200_000  # ids of the one hashed vocabulary all fields share
    c.data.ctr.weight_scale = 0.7  # std of the hidden click model's per-id weights (logits)
    c.data.ctr.bias = -1.0  # the hidden click model's bias (logits): sets the click rate
    c.data.ctr.zipf_a = 1.0  # popularity of the value of rank r falls as 1/(r + 1)**zipf_a
    # hashed: every (field, value) hashed into `vocab_size` ids (float32 features); raw: int64
    # ids over the whole 64-bit space, one per (field, item), for a table to collide or admit.
    c.data.ctr.id_space = "hashed"
    c.data.ctr.id_dtype = "int64"  # raw: int64 | string (the ids' decimal strings, "" padding)
    # raw: every `drift_every` examples a new item of each field enters at rank 0 and the
    # others fall one rank (new ids appear, old ones fade); 0: no drift.
    c.data.ctr.drift_every = 0
    # raw: the last `multi_valued` columns are a list of 1 to that many ids of one more field,
    # padded with 0 (or ""); 0: no list.
    c.data.ctr.multi_valued = 0
    # tfrecord / csv: the user's files.
    c.data.train_files = ""  # glob of training files
    c.data.eval_files = ""  # glob of eval files
    # tfrecord / csv: train on the files of `train_files` as they keep arriving (`data.follow*`).
    c.data.update(_declared("follow"))
    # tfrecord / csv: the features to read, "name:dtype[:shape|:var][=default],..." with dtype
    # float32 | int64 | string, a shape like 64 or 8x8x1 (none: one value), var: any length
    # (tfrecord, a ragged tensor), and the value a missing one takes (csv: one of `na_values`;
    # tfrecord: an example without it); e.g. "age:float32=0,country:string=unknown,ids:int64:var".
    # The model gets a dict of them by name, or one tensor of `input_shape` for "" (tfrecord:
    # the float feature `x`; csv: every column but the label) or one float32 feature with a
    # shape. csv reads only the columns named (each one value) and ignores the others.
    c.data.features = ""
    c.data.label = "label"  # tfrecord: label feature name; csv: label column name
    c.data.label_dtype = "int64"  # tfrecord: int64 for classification, float32 for regression
    # tfrecord / csv: a label of class names: the names in index order, comma-separated
    # (e.g. "Adelie,Chinstrap,Gentoo"), or "auto" (the sorted distinct values of the files,
    # found at start-up and written to config.json); its length is then the class count.
    # "" = the label is a number (a class index, or a value for regression).
    c.data.label_vocabulary = ""
    # csv: the values that mean missing, comma-separated (an empty value always does).
    c.data.na_values = "NA,N/A,NaN,nan,null"
    # tfrecord / csv: a row with a missing value and no default (in `features`): error (one
    # line naming file, line and column) | drop (left out; the count is told at start-up).
    c.data.incomplete = "error"
    # tfrecord / csv / your own pipeline: classes of the label (0 = regression); unused with
    # `label_vocabulary` and by a model compiled with its own loss.
    c.data.num_classes = 10
    c.data.input_shape = (64,)  # tfrecord / csv: shape of one example, when one tensor

    # Training: steps, batch, loops of steps, precision, checkpoints and recovery.
    c.train = ml_collections.ConfigDict()
    # total optimizer steps (a rerun continues to this); with `data.follow`, 0 = until stopped
    c.train.steps = 1000
    c.train.epochs = 0  # if > 0, steps = epochs * train examples // global batch
    c.train.global_batch_size = 128  # examples per step over all replicas
    # Gradient accumulation: each step's global batch runs as this many micro-batches, one
    # after another, whose gradients are summed into one update (one all-reduce); a step
    # still trains on `global_batch_size` examples with the memory of a micro-batch.
    c.train.accumulation_steps = 1
    # Steps inside one tf.function call (one progress line); 0 = auto: loops of about
    # 1 s, measured as it trains. 100 keeps the per-loop cost < 2% (`python -m trainer.bench`).
    c.train.steps_per_loop = 100
    # Steps traced one after another into each iteration of a loop's `while`: a step's
    # input then comes while the step before finishes its updates (a few % on a small
    # model), at the cost of one more trace of the step each at start-up. 0 = auto: 4 in a
    # one-process run of 50,000 steps or more, where a step has at most 1,000 ops; else 1.
    c.train.steps_per_iteration = 0
    c.train.precision = "float32"  # float32 | mixed_bfloat16 | mixed_float16 (with loss scaling)
    c.train.jit_compile = False  # compile each step's forward and backward pass with XLA
    c.train.async_checkpoint = True  # write checkpoints in the background (training goes on)
    c.train.checkpoint_every = 500  # steps between checkpoints (and one at the end)
    c.train.max_checkpoints = 3  # checkpoints kept in model_dir
    # Incremental checkpoints (models with a `DynamicEmbedding`): the first checkpoint at or
    # past each multiple of this many steps is full, the others between hold only the table
    # rows changed since it (and the rest whole); restoring one replays it over its full one.
    # Pays at short `checkpoint_every` (docs/recommendation.md). 0 = every one full.
    c.train.full_checkpoint_every = 0
    # Start a new run from another run's variables (`train.warm_start*`).
    c.train.update(_declared("warm_start"))
    c.train.export = True  # write a SavedModel to model_dir/export at the end
    c.train.loss_upper_bound = 0.0  # a loop loss above this counts as a blow-up (0 = none)
    c.train.max_recoveries = 3  # blow-ups recovered from the last good checkpoint, then stop
    c.train.deterministic = False  # deterministic ops: a restarted run ends bit-identical
    c.train.update(_declared("profile"))  # a TensorBoard profile of chosen steps
    # Your own loop actions, "module.path:function" (comma-separated): each function takes
    # the config and returns a callable on each block's output (see trainer/loop/controller.py).
    c.train.actions = ""

    # SavedModels written while training, for a server that follows the newest (docs/online.md).
    c.export = _declared("exports")

    # Evaluation: how often, its batch, an evaluator member's wait; progressive validation.
    c.eval = ml_collections.ConfigDict()
    c.eval.every = 500  # steps between evaluations (and one at the end); 0 = end only
    c.eval.global_batch_size = 256  # examples per eval step over all replicas
    c.eval.sidecar_timeout = 600.0  # evaluator member: seconds to wait for a new checkpoint
    c.eval.update(_declared("progressive"))  # progressive validation (docs/progressive.md)

    # The optimizer, its learning-rate schedule and its gradients' clipping.
    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adam"  # sgd | momentum | adam | adamw | adagrad | ftrl
    c.optimizer.learning_rate = 1e-3  # peak learning rate
    c.optimizer.momentum = 0.9  # momentum: the momentum coefficient
    c.optimizer.weight_decay = 1e-4  # adamw: decoupled weight decay
    c.optimizer.schedule = "cosine"  # constant | cosine | step
    c.optimizer.warmup_steps = 50  # linear warmup from 0 to the peak rate
    c.optimizer.decay_steps = (1000,)  # step schedule: steps at which the rate drops
    c.optimizer.decay_rate = 0.1  # step schedule: factor applied at each drop
    # False: an embedding table's gradient is made dense and every row (and slot) is updated
    # each step, as Keras does (`python -m trainer.bench --cases=tables` compares); True: only
    # the rows looked up. A `DynamicEmbedding` is always updated sparsely.
    c.optimizer.sparse_updates = True
    c.optimizer.clip_global_norm = 0.0  # clip gradients to this global norm (0 = off)
    return c

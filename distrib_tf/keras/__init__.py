"""What any Keras `fit` under a distrib_tf strategy gets: the library, apart from our main job.

- `compat`: the version-gated fixes that make Keras 3 `fit` work under
  `MultiWorkerMirroredStrategy` (every patch of a private Keras API lives there);
- `callbacks`: chief-only checkpoints, epoch timing;
- `backup`: every worker's own backups: their files, the background writer, retention;
- `resume`: the resume step every worker agrees on, and its state for a worker without it;
- `sigterm`: what a SIGTERM does in each phase (record, leave with 75, its default meaning);
- `preemption`: SIGTERM between any two batches, one agreed step, exit 75;
- `nonfinite`: every worker stops at the same step on a NaN or Inf loss, the culprit named;
- `progress`: throughput, ETA and the slowest worker;
- `local_sgd`: periodic weight averaging and compressed gradient all-reduce.
- `replica_state`: what layers update per replica (BatchNormalization's moving statistics),
  the mean over the replicas after every step.

Nothing here imports the main job (`distrib_tf.train`, `distrib_tf.data`, `distrib_tf.models`);
`make lint` checks it.
"""

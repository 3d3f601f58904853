"""The run API: every guarantee of distrib_tf for a user's own Keras script, as Keras writes it.

- `run`: `Run`, the strategy, Keras `fit`'s arguments, chief outputs, the clean end;
- `routing`: a script's own `model.fit(...)` goes through the live `Run`;
- `inputs`: `fit`'s data arguments (arrays, weights, `validation_split`, datasets) as sources;
- `stage`: one `fit` call, resumed at its agreed step (partial epoch, rollback), the
  guarantees' callbacks in their order;
- `options`: `RunOptions`, checked at construction; `checks`: `fit`'s arguments, checked first;
- `ending`: how a run's process ends, case by case: the exit codes a scheduler reads (2, 65,
  75), the end of each `fit`, leaving together;
- `export`: `model.keras` and a SavedModel, loadable without distrib_tf;
- `schedules`: a rollback's halved learning rate under a `LearningRateSchedule`.

It sits above `distrib_tf.keras` and `distrib_tf.data`; the main job (`distrib_tf.train`)
is its client.
"""

from distrib_tf.run.ending import InvalidRun
from distrib_tf.run.export import export_model
from distrib_tf.run.options import RunOptions
from distrib_tf.run.run import Run

__all__ = [
    "InvalidRun",
    "Run",
    "RunOptions",
    "export_model",
]

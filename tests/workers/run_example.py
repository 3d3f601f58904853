"""Runs an example script of `examples/` as `python SCRIPT` would, then prints what the
test compares: `EXAMPLE {"weights": sha256, "history": {key: [values]}}`, from this process.

    python tests/workers/run_example.py SCRIPT [--sigterm_at_step=N --sigterm_task=worker:1] [SCRIPT'S ARGS]

The script is not changed: a SIGTERM is sent from outside its code, by a callback added to
the callbacks its `fit` is given (as a scheduler would send it after a step).
"""

import argparse
import hashlib
import json
import os
import runpy
import signal
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("script")
    parser.add_argument("--sigterm_at_step", type=int, default=-1)
    parser.add_argument("--sigterm_task", default="worker:1")
    args, script_args = parser.parse_known_args()
    script = os.path.abspath(args.script)
    sys.path.insert(0, os.path.dirname(script))
    if args.sigterm_at_step > 0:
        _sigterm_at(args.sigterm_at_step, args.sigterm_task)
    sys.argv = [script, *script_args]
    names = runpy.run_path(script, run_name="__main__")
    model = names["model"]
    digest = hashlib.sha256()
    for array in model.get_weights():
        digest.update(array.tobytes())
    history = model.history.history if model.history is not None else {}
    print("EXAMPLE " + json.dumps({"weights": digest.hexdigest(), "history": history}), flush=True)


def _sigterm_at(step, task):
    import keras  # pylint: disable=import-outside-toplevel

    import distrib_tf  # pylint: disable=import-outside-toplevel

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == step:
                os.kill(os.getpid(), signal.SIGTERM)

    fit = distrib_tf.Run.fit

    def fit_with_fault(run, model, *args, callbacks=None, **kwargs):
        faults = [Fault()] if run.task == task else []
        return fit(run, model, *args, callbacks=[*(callbacks or ()), *faults], **kwargs)

    distrib_tf.Run.fit = fit_with_fault


if __name__ == "__main__":
    main()

"""A sweep's Optuna study: opened at its storage, the pruner, what a sweep started again finds.

The study is where `--storage` says (`distrib_tf.study`: SQLite beside the sweep by default,
PostgreSQL, or a journal file on a shared disk); everything a sweep needs to go on after
its process was killed is in it: the trials that ended, the interrupted ones to run again,
and the words it said on their epochs. This module imports no TensorFlow.
"""

import itertools

from distrib_tf import study as study_lib
from distrib_tf.experiments import sweep_results
from distrib_tf.experiments.sweep_space import Dimension
from distrib_tf.experiments.sweep_space import suggest

PRUNERS = ("none", "median", "halving", "hyperband")
# User attributes of `sweep_promotion`'s attempts: one that resumes a paused one (the step it
# resumes after), one paused at a rung (its step), one promoted to train to its end.
PROMOTED, PAUSED, TO_END = "promoted", "paused", "to_end"


def optuna_module():
    """Optuna, quiet (the sweep says what each trial did), or the one line that installs it."""
    try:
        import optuna  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ValueError("Missing Optuna, which sweeps are built on. Expected it installed: "
                         "pip install 'distrib_tf[sweep]'.") from e
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna


def make_pruner(name: str, *, startup_trials: int = 2, warmup_epochs: int = 0, reduction_factor: int | None = None):
    """Optuna's pruner called `name` (`PRUNERS`); `reduction_factor` None: Optuna's default."""
    pruners = optuna_module().pruners
    factor = {} if reduction_factor is None else {"reduction_factor": reduction_factor}
    return {"none": pruners.NopPruner,
            "median": lambda: pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_epochs),
            "halving": lambda: pruners.SuccessiveHalvingPruner(min_resource=max(1, warmup_epochs), **factor),
            "hyperband": lambda: pruners.HyperbandPruner(min_resource=max(1, warmup_epochs), **factor)}[name]()


def open_study(sweep_dir: str, space: list[Dimension], *, sampler: str, seed: int, mode: str,
               pruner: str = "none", startup_trials: int = 2, warmup_epochs: int = 0, storage: str | None = None,
               study_name: str = "distrib_tf", program: str | None = None, reduction_factor: int | None = None):
    """The sweep's Optuna study at `storage` (a URL of `distrib_tf.study.parse_url`; default: the
    SQLite file `sweep_dir/study.db`): created, or loaded to go on.

    A grid's points are asked for in the order written (`ask_new`); a random or TPE sampler
    is seeded with `seed` plus the trials the study holds, so that a sweep started again goes
    on drawing instead of repeating its first values. With `program` (what the trials run), a
    study that another program's sweep made, or one over other names, is refused.

    Raises:
        ValueError: the storage cannot be opened, or holds another sweep's study (one line).
    """
    optuna = optuna_module()
    url = storage or study_lib.default_url(sweep_dir)
    study = optuna.create_study(study_name=study_name, storage=study_lib.open_storage(url), load_if_exists=True,
                                direction="maximize" if mode == "max" else "minimize",
                                pruner=make_pruner(pruner, startup_trials=startup_trials, warmup_epochs=warmup_epochs,
                                                   reduction_factor=reduction_factor))
    if program is not None:
        names, made = [d.name for d in space], study.user_attrs
        if "program" in made and (made["program"], made.get("space")) != (program, names):
            raise ValueError(f"Invalid value for `--storage`. Received: {study_lib.hide_password(url)}, whose study "
                             f"{study_name!r} sweeps {made.get('space')} of {made['program']}. Expected a study of "
                             f"this sweep ({names} of {program}): another --study_name or --storage.")
        if "program" not in made:
            study.set_user_attr("program", program)
            study.set_user_attr("space", names)
    so_far = len(study.get_trials(deepcopy=False))
    study.sampler = (optuna.samplers.TPESampler if sampler == "tpe" else optuna.samplers.RandomSampler)(
        seed=seed + so_far)
    return study


def ask(study, space: list[Dimension]):
    """`study.ask()`, its values drawn at once (`suggest`): the study holds them from now on."""
    asked = study.ask()
    suggest(asked, space)
    return asked


def ask_new(study, space: list[Dimension], sampler: str):
    """A trial of new values: under a grid, the first point in the order written (the last
    name varies fastest) that no trial of the study holds; else the sampler's draw. Call it
    with no trial waiting in the study's queue (`study.ask` takes those first)."""
    if sampler == "grid":
        held = [t.params for t in study.get_trials(deepcopy=False)]
        for point in itertools.product(*(d.values for d in space)):
            if (values := dict(zip([d.name for d in space], point))) not in held:
                study.enqueue_trial(values)
                break
    return ask(study, space)


def refuse_other_engines_jobs(study, *, engine: str, url: str) -> None:
    """Raises ValueError (one line) if a running trial of `study` is a job of an engine other
    than `engine` (its `job` user attribute, `ENGINE:ID`): a sweep here would train its values
    again beside that job, which goes on; the sweep on that engine follows it to its end."""
    for trial in study.get_trials(deepcopy=False, states=(optuna_module().trial.TrialState.RUNNING,)):
        owner, _, number = str(trial.user_attrs.get("job", "")).partition(":")
        if number and owner != engine:
            raise ValueError(f"Invalid value for `--engine`. Received: {engine}, while trial {trial.number} of the "
                             f"study {study.study_name!r} in {study_lib.hide_password(url)} runs as {owner} job "
                             f"{number}. Expected --engine={owner}, which follows that job to its end (a sweep on "
                             "another engine would train its values again beside it).")


def leftovers(study, optuna, *, engine: str | None = None) -> tuple[list, list[tuple[dict, dict]], list]:
    """The trials that count against the budget, the values of interrupted ones to run
    again (with the `promoted` of a promoted attempt), and the running trials to follow again.
    A trial left running by a sweep that was killed is told failed (it has no cause:
    interrupted), and its values run again, resumed from their backups; on an `engine` (its
    name), a running trial whose job that engine runs (`job` user attribute `ENGINE:ID`) is
    left running: the sweep follows its job."""
    states = optuna.trial.TrialState
    followed = []
    for old in study.get_trials(deepcopy=False, states=(states.RUNNING,)):
        if engine and str(old.user_attrs.get("job", "")).startswith(f"{engine}:"):
            followed.append(old)
        else:
            study.tell(old.number, state=states.FAIL)
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state in (states.COMPLETE, states.PRUNED)
            or (t.state == states.FAIL and "cause" in t.user_attrs)]
    latest = {}  # The values' last attempt (a draw that repeated a trial's values is none).
    for t in trials:
        if t.params and t.state != states.WAITING and "same_as" not in t.user_attrs:
            latest[sweep_results.trial_id(t.params)] = t
    retry = []
    for t in latest.values():  # Its last attempt interrupted, not paused at a rung (`sweep_promotion`).
        if t.state == states.FAIL and "cause" not in t.user_attrs and PAUSED not in t.user_attrs:
            retry.append((t.params, {k: t.user_attrs[k] for k in (PROMOTED, TO_END) if k in t.user_attrs}))
    return done, retry, followed


def words_said(study, trial_id: str, *, promoted: bool = False) -> dict:
    """The sweep's words on earlier attempts of the values of `trial_id` that were interrupted;
    `promoted` (`distrib_tf.experiments.sweep_promotion`): on its paused attempts too, each
    `prune` (a pause) now `go`."""
    words, states = {}, optuna_module().trial.TrialState
    for old in study.get_trials(deepcopy=False, states=(states.FAIL, states.PRUNED)):
        if old.params and sweep_results.trial_id(old.params) == trial_id and (
                (old.state == states.FAIL and "cause" not in old.user_attrs) or promoted):
            words.update((k, "go" if promoted else v) for k, v in old.user_attrs.items() if k.startswith("prune:"))
    return words

"""Hyperparameter sweeps of your own script, each trial a distributed run.

Usage:

    distrib-tf-sweep --space='learning_rate=loguniform(1e-4,1e-2) units=[32,64]' --trials=8 \\
        --sampler=tpe --pruner=median --metric=val_accuracy [--cluster_spec=local_4workers \\
        --workers_per_trial=2] [--sweep_dir=runs/sweep] -- python my_script.py [ITS ARGS]

The script declares its hyperparameters with `hp = distrib_tf.params(learning_rate=1e-3,
units=64)` (`distrib_tf.trial`): outside a sweep they are its defaults; in a trial the
sweep's values, the same on every worker by construction (they travel in the launcher's
environment). Without a command after `--` (or with only flags there), the trial is the
main job (`python -m distrib_tf.train`) and `--space` names its flags.

Each trial is the command run by the launcher on `--workers_per_trial` local workers (or on
every task of the cluster spec), in its own directory `SWEEP_DIR/trial-<id>` (the id a hash
of its values), where `distrib_tf.Run` writes instead of its `model_dir`. The spec's local
tasks are the slots: trials run side by side as many at once as fit (4 slots: two 2-worker
trials), never two on one slot.

The objective is `--metric` (any metric of the run's epochs: `val_loss`, a user's metric)
as the run's chief reported it in its `epoch` events (`distrib_tf.events`), the best epoch's
(`--mode=max|min`). With `--pruner` (Optuna's median, successive halving or Hyperband),
each epoch's value is reported as it arrives; a trial the pruner stops ends on every worker
at that epoch's end with exit code 3 (`distrib_tf.keras.pruning`), its state kept. With
`--promote` (halving or Hyperband) such a trial is paused, not dropped: once it ranks at its
rung it is promoted and resumes from that backup (`distrib_tf.experiments.sweep_promotion`).

Built on Optuna (`pip install 'distrib_tf[sweep]'`), whose study records every trial:
`--storage=URL` (`distrib_tf.study`) puts it in `SWEEP_DIR/study.db` (SQLite, the default),
PostgreSQL (`postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE`) or a journal file on a
shared disk (`journal:PATH`); `--study_name` names it there. The pruner's word on each epoch
travels through the study: each trial's chief reads it through the URL in its environment
(with PostgreSQL the trials run on the host's network, so that their chiefs reach it).
The sweep's process is disposable: killed anywhere, SIGKILL included (its trials then back
up and stop: their launchers die with it), the same command picks the study up: finished
and pruned trials stay, an interrupted one resumes from its backups at its step once the
earlier launcher has stopped, the sampler goes on (seeded by the trials so far), and a grid
runs in the order written. Trials side by side take disjoint local ranks of the host (so
GPUs and CPUs); values drawn again while their trial runs wait for its result.
With `--engine=slurm` each trial is instead a Slurm batch job, the one
`distrib-tf-export slurm` writes (`--workers_per_trial` tasks, over `--nodes_per_trial`
nodes), submitted, followed and cancelled through Slurm's commands; with
`--engine=kubernetes`, the Indexed Job `distrib-tf-export kubernetes` writes, through
`kubectl` (`--image`; the claim `--volume_claim` at `--claim_mount` in every pod as here:
`distrib_tf.experiments.sweep_kubernetes`); with `--engine=ray`, a `distrib-tf-ray` run
submitted through Ray's job API at `--ray_address` (`distrib_tf.experiments.sweep_engines`).
The study must then be one every node reaches (PostgreSQL, or a journal file on a shared
disk: SQLite is refused), and so must `--sweep_dir`. Killed, such a sweep leaves its jobs
running (they are the engine's): the same command follows them again; Ctrl-C or SIGTERM
cancels them.
A trial that fails for its own reason (a NaN, a bad value) is recorded with its cause and
the sweep goes on. Results (`distrib_tf.experiments.sweep_results`): `results.csv`, a live
line, and `sweep.png`. Bad input (a bad `--storage`, a database that does not answer in
10 s, a study another script's sweep made) prints one line and exits 2 before anything starts. Exit
codes: 0 every trial finished or was pruned; 1 some failed; 2 bad input; 75 SIGTERM, every
running trial backed up (start it again); 130 interrupted.

This module imports no TensorFlow.
"""

import os
import shlex
import signal
import sys
import threading
import time

from distrib_tf import argparsing
from distrib_tf import events
from distrib_tf import exit_codes
from distrib_tf import study as study_lib
from distrib_tf.experiments import sweep_engines
from distrib_tf.experiments import sweep_promotion
from distrib_tf.experiments import sweep_results
from distrib_tf.experiments.sweep_args import check
from distrib_tf.experiments.sweep_args import parse_args
from distrib_tf.experiments.sweep_args import program_of
from distrib_tf.experiments.sweep_space import suggest
from distrib_tf.experiments.sweep_study import PRUNERS  # noqa: F401  (re-exported)
from distrib_tf.experiments.sweep_study import ask
from distrib_tf.experiments.sweep_study import ask_new
from distrib_tf.experiments.sweep_study import leftovers
from distrib_tf.experiments.sweep_study import make_pruner  # noqa: F401  (re-exported)
from distrib_tf.experiments.sweep_study import open_study
from distrib_tf.experiments.sweep_study import optuna_module
from distrib_tf.experiments.sweep_study import refuse_other_engines_jobs
from distrib_tf.experiments.sweep_study import words_said
from distrib_tf.experiments.sweep_trial import Sweep
from distrib_tf.experiments.sweep_trial import Trial
from distrib_tf.experiments.sweep_trial import TrialFailed
from distrib_tf.experiments.sweep_trial import root_cause
from distrib_tf.experiments.sweep_trial import wait_for_earlier


def run_sweep(study, sweep: Sweep, *, total: int, parallel: int, board) -> int:
    """Runs `study` up to `total` trials, `parallel` at a time, each a distributed run.

    Returns 0 once it ran to the end; interrupted (Ctrl-C or SIGTERM, the running trials
    told to back up and stop, and stopped), 75 for a SIGTERM that every trial saved on, else 130.
    """
    optuna = optuna_module()
    done, retry, adopted = leftovers(study, optuna, engine=sweep.engine and sweep.engine.name)
    for values, attrs in retry:
        study.enqueue_trial(values, user_attrs=attrs or None)
    ended = {sweep_results.trial_id(t.params): (t.state.name, t.value, t.number) for t in done}
    running: dict[int, Trial] = {}
    busy: dict[str, int] = {}  # The values (their trial id) of every trial under way -> its number.
    lock, stopping = threading.RLock(), threading.Event()
    changed = threading.Condition(lock)  # A trial under way ended.
    received: list[int] = []
    codes: list[int] = []  # The exit codes of the trials the sweep's interruption stopped.

    def objective(asked, slot, followed=None):
        values = suggest(asked, sweep.space)
        trial = Trial(asked.number, values, os.path.join(sweep.sweep_dir, f"trial-{sweep_results.trial_id(values)}"),
                      promoted=int(asked.user_attrs.get(sweep_promotion.PROMOTED, 0)))
        with changed:  # A sampler may draw the values of a trial under way: never two runs of them at once.
            if trial.promoted:  # Paused, and promoted: its attempts so far are not its result.
                ended.pop(trial.id, None)
            if trial.id in busy:
                sweep.say(f"trial {trial.number} {values}: the same as trial {busy[trial.id]}, which runs; "
                          "waits for its result")
            while trial.id in busy and not stopping.is_set():
                changed.wait(0.5)
            if stopping.is_set():
                raise TrialFailed("the sweep was interrupted")
            if trial.id not in ended:
                busy[trial.id] = trial.number
        if trial.id in ended:  # A draw that repeats an ended trial: its result, not a second run.
            state, value, number = ended[trial.id]
            sweep.say(f"trial {trial.number} {values}: the same as trial {number}, not run again")
            asked.set_user_attr("same_as", number)
            if state == "PRUNED":
                raise optuna.TrialPruned()
            if state != "COMPLETE":
                asked.set_user_attr("cause", f"the same as trial {number}")
                raise TrialFailed()
            return value
        try:
            return run_trial(asked, trial, slot, followed)
        finally:
            with changed:
                del busy[trial.id]
                changed.notify_all()

    def run_trial(asked, trial, slot, followed):
        asked.set_user_attr("dir", trial.model_dir)
        resumed = os.path.isdir(os.path.join(trial.model_dir, "backup"))
        for key, word in words_said(study, trial.id, promoted=bool(trial.promoted)).items():  # They stand.
            trial.words[key] = word
            asked.set_user_attr(key, word)
        job = followed and followed.user_attrs["job"]
        if followed:  # A job an earlier sweep submitted: the words it said on it stand.
            trial.words.update((k, v) for k, v in followed.user_attrs.items() if k.startswith("prune:"))
            trial.reported.update(followed.intermediate_values)
        if sweep.engine is None:
            wait_for_earlier(trial.model_dir, say=sweep.say, stopping=stopping)
        with lock:
            if stopping.is_set():
                raise TrialFailed("the sweep was interrupted")
            if sweep.engine is None:
                sweep.launch(trial, slot)
            else:
                trial.submitted = followed.datetime_start.timestamp() if followed else time.time()
                trial.job = job or submit(asked, trial)
                trial.started, trial.status = time.monotonic(), "running"
            running[asked.number] = trial
        if followed:
            board.followed(trial)
        elif trial.promoted:
            board.promoted(trial)
        else:
            board.started(trial, resumed)
        code = follow_until_end(asked, trial)
        with lock:
            del running[asked.number]
        seconds = time.monotonic() - trial.started
        best = sweep_results.best(trial.curve, sweep.mode)
        if code == exit_codes.PRUNED:
            trial.status = "pruned"
        elif code == exit_codes.OK and best is not None:
            trial.status = "finished"
        elif stopping.is_set() or code in (exit_codes.PREEMPTED, exit_codes.INTERRUPTED):
            trial.status = "interrupted"
            codes.append(code)
        else:
            trial.status = "failed"
            trial.cause = root_cause(trial.model_dir) if code else (
                f"no {sweep.metric} in its epochs (the metrics its chief reported: "
                f"{', '.join(trial.logged) or 'none'})")
        board.ended(trial, seconds)
        if trial.status == "interrupted":
            raise TrialFailed("interrupted")
        ended[trial.id] = ({"pruned": "PRUNED", "failed": "FAIL"}.get(trial.status, "COMPLETE"), best, trial.number)
        if trial.status == "pruned":
            raise optuna.TrialPruned()
        if trial.status == "failed":
            asked.set_user_attr("cause", trial.cause)
            raise TrialFailed(trial.cause)
        return best

    def submit(asked, trial):
        try:
            job = sweep.engine.submit(trial, sweep)
        except sweep_engines.EngineError as e:
            trial.status, trial.cause = "failed", str(e)
            asked.set_user_attr("cause", trial.cause)
            raise TrialFailed(trial.cause) from e
        asked.set_user_attr("job", job)  # Before anything else: a sweep started again follows it.
        sweep_engines.record_job(trial.model_dir, job)
        return job

    def follow_until_end(asked, trial) -> int:
        """Follows the trial's events until its launcher or job ends: its exit code. A job on an
        engine is asked for its state every few seconds, and cancelled once the sweep stops."""
        follower = events.Follower(os.path.join(trial.model_dir, "events.jsonl"))
        code, asked_at, cancelled, said = None, 0.0, 0.0, ""
        while True:
            if sweep.engine is None:
                code = trial.proc.poll()
            else:
                if stopping.is_set() and not cancelled:
                    cancelled = time.time()
                    try:
                        sweep.engine.cancel(trial.job)
                    except sweep_engines.EngineError as e:
                        sweep.say(f"trial {trial.number}: {e}")
                if time.monotonic() - asked_at >= sweep_engines.POLL_SECONDS:
                    asked_at = time.monotonic()
                    try:
                        code = sweep.engine.poll(trial.job, trial.model_dir)
                    except sweep_engines.EngineError as e:
                        code = None  # The engine busy, or no access: said once, and asked again.
                        if str(e) != said:
                            said = str(e)
                            sweep.say(f"trial {trial.number}: {said} (asking again)")
            if code is not None:
                break
            sweep.follow(trial, asked, follower, board)
            time.sleep(0.2)
        sweep.follow(trial, asked, follower, board)
        if code == sweep_engines.GONE or (cancelled and code):  # What its tasks' launchers said, this job.
            code = sweep_engines.exit_code_from_events(trial.model_dir, since=cancelled or trial.submitted)
        return code

    def interrupt(signum, frame):
        stopping.set()
        received.append(signum)
        with lock:
            for trial in running.values():
                if trial.proc is not None:  # On an engine, its follower cancels the job.
                    os.killpg(trial.proc.pid, signal.SIGTERM)  # Every worker backs up one step, then stops.

    left = [total - len(done)]  # Trials still to ask for (with a ladder: values still to draw).
    asking = threading.Lock()
    under_way = [0]  # Trials asked for and not yet told.
    ladder = sweep.ladder

    def pick():
        """The next trial and the job it follows, or None for none now: a job an earlier sweep
        submitted, an interrupted trial's values, with a ladder a paused trial that ranks now
        (promoted), then new values while the budget lasts."""
        if ladder is None and left[0] <= 0:
            return None
        if adopted:  # A job an earlier sweep submitted.
            left[0] -= 1
            followed = adopted.pop(0)
            return optuna.trial.Trial(study, followed._trial_id), followed  # pylint: disable=protected-access
        queued = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))  # Interrupted ones.
        if ladder is None:
            left[0] -= 1
            return (ask(study, sweep.space) if queued else ask_new(study, sweep.space, sweep.sampler)), None
        if queued:
            return ask(study, sweep.space), None
        everyone = sweep_promotion.values_of(study)
        if (up := ladder.promotion(everyone)) is not None:
            return promote(up), None
        if len(everyone) + sum("same_as" in t.user_attrs for t in study.get_trials(deepcopy=False)) < total:
            return ask_new(study, sweep.space, sweep.sampler), None
        if not under_way[0] and (up := ladder.last_promotion(everyone)) is not None:
            return promote(up, to_end=True), None
        return None

    def promote(paused, *, to_end=False):
        """An attempt of `paused`'s values that resumes after its rung (none else waits: `pick`)."""
        attrs = {sweep_promotion.PROMOTED: paused.paused, **({sweep_promotion.TO_END: True} if to_end else {})}
        study.enqueue_trial(paused.params, user_attrs=attrs)
        return ask(study, sweep.space)

    def next_trial():
        """`pick`'s trial, counted as under way; None once there is none to run. With a ladder,
        a thread with nothing to run waits while a trial is under way: it may pause, and rank."""
        while not stopping.is_set():
            with asking:
                if (found := pick()) is not None:
                    under_way[0] += 1
                    return found
                if ladder is None or not under_way[0]:
                    return None
            time.sleep(0.5)
        return None

    def worker(slot):
        """Runs trials and tells their outcomes until `next_trial` has none, each on the
        `slot`-th group of slots. One ask at a time: Optuna's SQLite storage can hand two
        threads the same enqueued trial (seen: both ran trial 0), as its `optimize(n_jobs=...)` does."""
        while (found := next_trial()) is not None:
            asked, followed = found
            try:
                study.tell(asked, objective(asked, slot, followed))
            except optuna.TrialPruned:
                study.tell(asked, state=optuna.trial.TrialState.PRUNED)
            except TrialFailed:
                study.tell(asked, state=optuna.trial.TrialState.FAIL)
            finally:
                with asking:
                    under_way[0] -= 1

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    # Every job still on the engine is followed.
    parallel = max(parallel, len(adopted) if ladder else min(len(adopted), left[0]))
    try:
        if left[0] > 0 or ladder is not None:  # A ladder may promote when every value was drawn.
            board.start(total + sum(sweep_promotion.PROMOTED in t.user_attrs for t in done), len(done))
            workers = [threading.Thread(target=worker, args=(i,), name=f"distrib_tf-sweep-{i}")
                       for i in range(parallel)]
            for thread in workers:
                thread.start()
            for thread in workers:
                while thread.is_alive():  # In short waits: the signal handlers run in this thread.
                    thread.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        board.stop()
    if not stopping.is_set():
        return exit_codes.OK
    if received[:1] == [signal.SIGTERM] and all(code == exit_codes.PREEMPTED for code in codes):
        return exit_codes.PREEMPTED  # A scheduler's notice, every trial backed up: start it again.
    return exit_codes.INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        plan = check(args)
        space, total, command, main_job = plan.space, plan.total, plan.command, plan.main_job
        slots, per_trial, engine, url = plan.slots, plan.per_trial, plan.engine, plan.url
        off_host = engine is not None
        if not args.storage:
            os.makedirs(args.sweep_dir, exist_ok=True)
        study = open_study(args.sweep_dir, space, sampler=args.sampler, seed=args.seed, mode=args.mode,
                           pruner="none" if args.promote else args.pruner, reduction_factor=args.reduction_factor,
                           startup_trials=args.pruner_startup_trials,
                           warmup_epochs=args.pruner_warmup_epochs, storage=url, study_name=args.study_name,
                           program=program_of(command, main_job))
        refuse_other_engines_jobs(study, engine=args.engine, url=url)
    except ValueError as e:  # ClusterSpecError included.
        print(f"distrib-tf-sweep: error: {e}", file=sys.stderr)
        return exit_codes.USAGE
    if off_host:
        parallel, shares, where = args.parallel or 1, False, []
        placed = (f"as {args.engine} jobs of {per_trial} worker(s)"
                  + (f" on {args.nodes_per_trial} nodes" if args.nodes_per_trial else ""))
    else:
        parallel = min(slots // per_trial, args.parallel or slots)
        shares = bool(args.workers_per_trial and per_trial < slots)  # Trials side by side on the slots.
        where = [f"--workers={per_trial}"] if shares else [f"--cluster_spec={args.cluster_spec}"]
        placed = f"on {per_trial} of the {slots} slots of {args.cluster_spec} each"
    os.makedirs(args.sweep_dir, exist_ok=True)
    program = "the main job" if main_job else shlex.join(argparsing.command_after(args.command))
    print(f"sweep: {args.sampler} over {[d.name for d in space]} of {program}, {total} trial(s), {parallel} at a "
          f"time {placed}; pruner {args.pruner}; study {args.study_name!r} in {study_lib.hide_password(url)}",
          flush=True)
    sweep = Sweep(space, os.path.abspath(args.sweep_dir) if off_host else args.sweep_dir, command, where,
                  args.metric, args.mode, args.pruner != "none", storage=url, study_name=args.study_name,
                  workers=per_trial if shares else 0, parallel=parallel, engine=engine, sampler=args.sampler,
                  ladder=sweep_promotion.Ladder(args.mode, eta=args.reduction_factor or 3,
                                                min_epochs=max(1, args.pruner_warmup_epochs),
                                                hyperband=args.pruner == "hyperband") if args.promote else None)
    board = sweep_results.Board(args.metric, args.mode, sys.stdout)
    sweep.say = board.say
    code = run_sweep(study, sweep, total=total, parallel=parallel, board=board)
    rows = sweep_results.write(study, sweep.sweep_dir, space, metric=args.metric, mode=args.mode)
    if code != exit_codes.OK:
        print("sweep: interrupted; every running trial backed up and stopped. Run the same command to go on.",
              file=sys.stderr)
        return code
    print(sweep_results.format_table(rows, [d.name for d in space], args.metric))
    if args.promote:
        promotions, trained, over = sweep_promotion.saved(study)
        print(f"promotion: {promotions} promoted from their backups; {trained} epochs trained, against {over} "
              f"had each promoted trial started over ({1 - trained / max(over, 1):.0%} fewer)")
    plot = sweep_results.plot(rows, [d.name for d in space], os.path.join(args.sweep_dir, "sweep.png"),
                              metric=args.metric, mode=args.mode)
    print(f"results: {args.sweep_dir}/results.csv" + (f", {plot}" if plot else ""))
    return exit_codes.FAILED if any(r["status"] == "failed" for r in rows) else exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())

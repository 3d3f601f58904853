"""Successive halving and Hyperband that promote a trial from its backup (`--promote`).

Asynchronous successive halving with promotion (ASHA, Li et al. 2020): the trials of bracket
`b` are judged at the rungs `r * eta**(b + k)` (epochs counted over every `fit` in turn,
`sweep_results.step_of`; `r`: `--pruner_warmup_epochs` or 1, `eta`: `--reduction_factor`).
A trial that reaches a rung goes on if its value there ranks in the top `n // eta` of the
`n` trials of its bracket that reached that rung so far; else it is paused: the sweep says
`prune` on that epoch and every worker backs up that step and stops (exit code 3,
`distrib_tf.keras.pruning`). Each time a trial may start, a paused trial that ranks in the
top `n // eta` of its rung now (later trials reached it) is promoted before new values are
drawn: a new attempt of its values, in its directory, resumes from that backup at that step,
so the epochs it trained are not trained again, and it ends on the weights of the same
values trained without a pause (Optuna's pruners stop a trial for good).
Successive halving is the one bracket `b = 0`; Hyperband has brackets `0 .. s` for
`s = floor(log_eta(E / r))`, `E` the first fit's epochs as the first trial reported them,
values going to them in turn, in the order drawn, at their first rung.

Everything is read from the study (each attempt an Optuna trial: `promoted` on a promoted
attempt, `paused` on a paused one, `bracket` on the first): a sweep started again schedules
as the one it replaces. With a budget of values (`--trials`), once every value was drawn and
no trial runs, the best paused trial at a bracket's highest rung that no trial went past is
promoted all the same, to train to its end without another pause (`Ladder.last_promotion`):
a bracket whose trials do not fail ends with one trained to its end. An attempt interrupted
once the sweep said its pause counts as paused. A paused trial never promoted ends the sweep
as pruned. A fit's last epoch is never a rung. This module
imports no TensorFlow.
"""

import dataclasses
import math

from distrib_tf.experiments import sweep_results
from distrib_tf.experiments import sweep_study
from distrib_tf.experiments.sweep_study import optuna_module

PAUSED = sweep_study.PAUSED  # User attribute of an attempt the ladder paused: the step of its rung.
PROMOTED = sweep_study.PROMOTED  # Of an attempt that resumes a paused one: the step it resumes after.
TO_END = sweep_study.TO_END  # Of one promoted at the sweep's end (`Ladder.last_promotion`): no rung pauses it.
BRACKET = "bracket"  # Of the attempt whose first rung placed the values in a bracket.
EPOCHS = "epochs_per_trial"  # Study attribute: the first fit's epochs, once a trial reported them.


@dataclasses.dataclass
class Values:
    """One set of values, over all its attempts (Optuna trials of those params)."""

    params: dict
    bracket: int | None  # None until its first rung (`bracket_of`).
    first: int  # Its first attempt's number.
    curve: dict  # Step -> the metric, over every attempt.
    paused: int | None  # The rung it waits at, if its last attempt was paused and not promoted.
    to_end: bool = False  # Promoted to train to its end (`Ladder.last_promotion`).


@dataclasses.dataclass
class Ladder:
    """The rungs and the rule (see the module). `mode`: `max` or `min`."""

    mode: str
    eta: int = 3
    min_epochs: int = 1
    hyperband: bool = False

    def brackets(self, epochs: int | None) -> int:
        if not self.hyperband or not epochs:
            return 1
        return 1 + max(0, math.floor(math.log(epochs / self.min_epochs, self.eta) + 1e-9))

    def is_rung(self, step: int, bracket: int) -> bool:
        """Whether `step` is a rung of `bracket` (a fit's last epoch is none: `Sweep._word`)."""
        first = self.min_epochs * self.eta ** bracket
        while first < step:
            first *= self.eta
        return first == step

    def _top(self, values: list[tuple[float, int]]) -> list[int]:
        """The numbers in the top `n // eta` of (value, number) pairs (ties: the earlier first)."""
        sign = -1 if self.mode == "max" else 1
        ranked = sorted(values, key=lambda v: (sign * v[0], v[1]))
        return [number for _, number in ranked[:len(ranked) // self.eta]]

    def bracket_of(self, everyone: list[Values], me: Values, epochs: int | None) -> int:
        """`me`'s bracket: its own, else its turn among the values in the order first drawn."""
        if me.bracket is not None:
            return me.bracket
        return sorted(v.first for v in everyone).index(me.first) % self.brackets(epochs)

    def word(self, everyone: list[Values], me: Values, step: int) -> str:
        """`prune` (pause) if `step` is a rung of `me`'s bracket where it does not rank, else `go`."""
        if me.to_end or not self.is_rung(step, me.bracket) or step not in me.curve:
            return "go"
        there = [(v.curve[step], v.first) for v in everyone if v.bracket == me.bracket and step in v.curve]
        return "go" if me.first in self._top(there) else "prune"

    def promotion(self, everyone: list[Values]) -> Values | None:
        """The paused values to promote now, the highest rung first, else None."""
        for bracket in sorted({v.bracket for v in everyone} - {None}):
            mine = [v for v in everyone if v.bracket == bracket]
            for step in sorted({v.paused for v in mine if v.paused}, reverse=True):
                there = [(v.curve[step], v.first) for v in mine if step in v.curve]
                top = self._top(there)
                waiting = [v for v in mine if v.paused == step and v.first in top]
                if waiting:
                    return min(waiting, key=lambda v: top.index(v.first))
        return None


    def last_promotion(self, everyone: list[Values]) -> Values | None:
        """Once no values are left to draw and no trial runs: the best paused at the highest rung
        of a bracket that no trial went past (a top share of a few is none), promoted to train
        to its end without another pause (`TO_END`), else None."""
        for bracket in sorted({v.bracket for v in everyone} - {None}):
            mine = [v for v in everyone if v.bracket == bracket]
            paused = [v for v in mine if v.paused]
            if not paused:
                continue
            step = max(v.paused for v in paused)
            if not any(max(v.curve, default=0) > step for v in mine):
                sign = -1 if self.mode == "max" else 1
                return min((v for v in paused if v.paused == step), key=lambda v: (sign * v.curve[step], v.first))
        return None


def values_of(study) -> list[Values]:
    """Every set of values in the study, with their attempts merged (see `Values`)."""
    states = optuna_module().trial.TrialState
    grouped: dict[str, list] = {}
    for t in study.get_trials(deepcopy=False):
        if t.params and t.state != states.WAITING and "same_as" not in t.user_attrs:
            grouped.setdefault(sweep_results.trial_id(t.params), []).append(t)
    found = []
    for attempts in grouped.values():
        attempts.sort(key=lambda t: t.number)
        curve = {}
        for t in attempts:
            curve.update(t.intermediate_values)
        last = attempts[-1]
        # Paused at a rung: pruned, or interrupted once the word was said (the sweep killed then).
        paused = last.user_attrs.get(PAUSED) if last.state in (states.PRUNED, states.FAIL) and \
            "cause" not in last.user_attrs else None
        bracket = next((int(a.user_attrs[BRACKET]) for a in attempts if BRACKET in a.user_attrs), None)
        found.append(Values(attempts[0].params, bracket, attempts[0].number, curve, paused,
                            bool(last.user_attrs.get(TO_END))))
    return found


def saved(study) -> tuple[int, int, int]:
    """(promotions, epochs the sweep trained, epochs it would have trained had every promoted
    attempt started over): each attempt trains from where the attempts of its values before
    it ended (a promoted one: its rung; an interrupted one's retry: its backup, about there)."""
    states = optuna_module().trial.TrialState
    promotions = trained = over = 0
    reached: dict[str, int] = {}  # Values -> the last step their attempts so far reported.
    for t in study.get_trials(deepcopy=False):
        if not t.params or t.state == states.WAITING or "same_as" in t.user_attrs:
            continue
        key, last = sweep_results.trial_id(t.params), max(t.intermediate_values, default=0)
        start = reached.get(key, 0)
        promotions += PROMOTED in t.user_attrs
        trained += max(0, last - start)
        over += last if PROMOTED in t.user_attrs else max(0, last - start)
        reached[key] = max(start, last)
    return promotions, trained, over

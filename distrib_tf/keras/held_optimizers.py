"""The optimizers a model holds besides `model.optimizer`: part of the state a backup holds.

keras.io's GANs (DCGAN, WGAN-GP, CycleGAN) compile with optimizers of their own, held as
attributes (`self.d_optimizer`, `self.g_optimizer`), which their `train_step` applies;
Keras builds each at its first `apply_gradients`, inside the traced step, on the variables
it is applied to. A backup holds their variables (slots and `iterations`) after the
model's and `model.optimizer`'s, and names, for each, the attribute and the positions in
`model.variables` of the variables it was built on (`describe`): a resume builds it on
those (`build`) before restoring, where Keras would at the first step, so that the same
variables are there to restore. An optimizer applied to a variable that is not the
model's is left out of the backups, in one line.

Example:

    >>> describe(gan)  # After a step.
    [['d_optimizer', [0, 1, 2, 3]], ['g_optimizer', [4, 5, 6, 7, 8, 9]]]
    >>> build(new_gan, describe(gan))  # Before a resume restores their variables.
"""

import keras

from distrib_tf.keras import compat

_said: set = set()  # The optimizers said to be left out (`describe`), once each.


def held(model) -> list:
    """`(attribute, optimizer)` for each Keras optimizer among `model`'s attributes other than
    `model.optimizer`, by attribute name, each optimizer once."""
    main = getattr(model, "optimizer", None)
    seen, found = {id(main)}, []
    for name in sorted(vars(model)):
        value = vars(model)[name]
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in seen:
            seen.add(id(value))
            found.append((name, value))
    return found


def describe(model) -> list:
    """`[attribute, [positions in model.variables]]` of each held optimizer that is built on
    the model's variables: what a backup holds of them, in that order."""
    position = {id(v): i for i, v in enumerate(model.variables)}
    described = []
    for name, optimizer in held(model):
        if not optimizer.built:
            continue
        places = [position.get(id(v)) for v in compat.built_on(optimizer)]
        if None in places:
            if name not in _said:
                _said.add(name)
                print(f"model.{name} updates variables that are not the model's: its state (slots, iterations) "
                      "is not backed up, and a resume starts it afresh; expected it to train the model's own "
                      "variables", flush=True)
            continue
        described.append([name, places])
    return described


def build(model, described) -> None:
    """Builds each held optimizer `described` names that is not built yet on the model's
    variables at its positions, under the model's strategy, as Keras builds it at its first
    step."""
    optimizers = dict(held(model))
    for name, places in described or ():
        optimizer = optimizers.get(name)
        if optimizer is not None and not optimizer.built:
            with model.distribute_strategy.scope():
                optimizer.build([model.variables[i] for i in places])


def variables(model, described) -> list:
    """The variables of the held optimizers `described` names (`describe`'s, a backup's), in
    that order: what a backup holds after the model's and `model.optimizer`'s."""
    optimizers = dict(held(model))
    return [v for name, _ in described or () if name in optimizers for v in optimizers[name].variables]

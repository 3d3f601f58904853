"""A sweep's study: its storage, named by a URL, and the sweep's word on each epoch in it.

`distrib-tf-sweep --storage=URL` takes:

- `sqlite:///PATH` (the default, `SWEEP_DIR/study.db`): one host's disk;
- `postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DATABASE` (`postgresql://` says the
  same): Optuna's RDB storage on a PostgreSQL server, which every node of a trial reaches;
- `journal:PATH`: Optuna's journal storage, one append-only file on a disk every host
  shares (NFS), for users without a database server.

The sweep writes its word on a trial's epoch into the study, as the trial's user attribute
`prune:F:E` (fit F of the script, epoch E of that fit: `prune` or `go`), once it has
reported the epoch's metric to the pruner. Each trial is told the storage's URL, the
study's name and its own number in its environment (`distrib_tf.trial`), and its chief
reads the word there (`Words`): no file only one host sees.

No TensorFlow here; Optuna is imported when a storage is opened.

Example:

    >>> parse_url("journal:/shared/sweep.log")
    'journal:/shared/sweep.log'
"""

import os

CONNECT_SECONDS = 10  # The longest an unreachable database server is waited for.
_FORMS = "sqlite:///PATH, postgresql+psycopg://USER@HOST:PORT/DATABASE or journal:PATH"


def _invalid(received: str, expected: str = _FORMS) -> ValueError:
    return ValueError(f"Invalid value for `--storage`. Received: {received!r}. Expected {expected}.")


def default_url(sweep_dir: str) -> str:
    """The local SQLite file beside the sweep's trials."""
    return "sqlite:///" + os.path.abspath(os.path.join(sweep_dir, "study.db"))


def parse_url(text: str) -> str:
    """`text` as a storage URL every process can open (paths made absolute). Pure of the disk
    but for the check that a file's directory exists.

    Raises:
        ValueError: not a form this module takes (one line, naming `--storage`).
    """
    if text.startswith("journal:"):
        path = text[len("journal:"):].removeprefix("//")
        if not path:
            raise _invalid(text)
        path = os.path.abspath(path)
        if not os.path.isdir(os.path.dirname(path)):
            raise _invalid(text, f"journal:PATH, a file in an existing directory on a disk every host shares "
                                 f"(no directory {os.path.dirname(path)})")
        return f"journal:{path}"
    scheme, sep, rest = text.partition("://")
    if not sep or not rest:
        raise _invalid(text)
    if scheme == "sqlite":
        path = rest.removeprefix("/")
        if not path or path == ":memory:":
            raise _invalid(text, "sqlite:///PATH, a file (a study in memory ends with the sweep)")
        return "sqlite:///" + os.path.abspath(path)
    if scheme in ("postgresql", "postgresql+psycopg"):
        try:
            from sqlalchemy.engine import make_url  # pylint: disable=import-outside-toplevel
            url = make_url("postgresql+psycopg://" + rest)
        except ImportError as e:
            raise ValueError("Missing SQLAlchemy, which Optuna's database storage uses. Expected it installed: "
                             "pip install 'distrib_tf[sweep]'.") from e
        except Exception as e:  # sqlalchemy.exc.ArgumentError, ValueError: a URL it cannot read.
            raise _invalid(text) from e
        if not url.host or not url.database:
            raise _invalid(hide_password(text), "postgresql+psycopg://USER@HOST:PORT/DATABASE, with a host "
                                                "and a database")
        return url.render_as_string(hide_password=False)
    raise _invalid(hide_password(text))


def hide_password(url: str) -> str:
    """`url` with its password, if any, shown as `***`. Pure."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def open_storage(url: str, *, connect_seconds: float = CONNECT_SECONDS):
    """Optuna's storage at `url` (from `parse_url`), reached within `connect_seconds`.

    A database connection lives for one call (SQLAlchemy's `NullPool`): none is left open to
    a process's teardown (psycopg warns of each), and a server restarted under a long sweep
    costs its callers nothing but the calls made while it was down.

    Raises:
        ValueError: Optuna or the database driver is missing, or the database cannot be
            reached (one line, naming `--storage` and the URL without its password).
    """
    try:
        import optuna  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ValueError("Missing Optuna, which sweeps are built on. Expected it installed: "
                         "pip install 'distrib_tf[sweep]'.") from e
    if url.startswith("journal:"):
        from optuna.storages import journal  # pylint: disable=import-outside-toplevel
        return journal.JournalStorage(journal.JournalFileBackend(url[len("journal:"):]))
    kwargs = {}
    if url.startswith("postgresql"):
        try:
            import psycopg  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        except ImportError as e:
            raise ValueError("Missing psycopg, the PostgreSQL driver of `--storage=postgresql+psycopg://...`. "
                             "Expected it installed: pip install 'distrib_tf[sweep]'.") from e
        from sqlalchemy.pool import NullPool  # pylint: disable=import-outside-toplevel
        kwargs = {"engine_kwargs": {"connect_args": {"connect_timeout": max(1, int(connect_seconds))},
                                    "poolclass": NullPool}}
    try:
        return optuna.storages.RDBStorage(url, **kwargs)
    except Exception as e:  # sqlalchemy.exc.OperationalError and kin: a server that does not answer.
        reason = " ".join(str(getattr(e, "orig", None) or e).split())[:200]
        raise ValueError(f"Cannot open the study for `--storage`. Received: {hide_password(url)} ({reason}). "
                         f"Expected a database that answers within {connect_seconds:.0f} s: check that its "
                         "server runs, and its host, port, user, password and database.") from e


def word_key(fit: int, epoch: int) -> str:
    """The user attribute that holds the sweep's word on epoch `epoch` of fit `fit`. Pure."""
    return f"prune:{fit}:{epoch}"


class Words:
    """A trial's reader of the sweep's words in the study (its chief's side).

    Example:

        words = Words(url, study_name="distrib_tf", number=3)
        words.get(fit=1, epoch=2)  # "prune", "go", or None while the sweep has not said.
    """

    def __init__(self, url: str, *, study_name: str, number: int):
        self.url, self.study_name, self.number = url, study_name, number
        self._storage = self._trial_id = None

    def get(self, *, fit: int, epoch: int) -> str | None:
        """The word on that epoch, or `None` not yet. Raises what the storage raises."""
        if self._trial_id is None:
            self._storage = open_storage(self.url)
            study_id = self._storage.get_study_id_from_name(self.study_name)
            self._trial_id = self._storage.get_trial_id_from_study_id_trial_number(study_id, self.number)
        return self._storage.get_trial_user_attrs(self._trial_id).get(word_key(fit, epoch))

    def __repr__(self) -> str:
        return f"Words({hide_password(self.url)!r}, study_name={self.study_name!r}, number={self.number})"

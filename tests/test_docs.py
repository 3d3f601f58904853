"""The documentation: every name the API reference lists imports and has a docstring, and
every code block of the README and the guides is run by a test or says why not."""

import glob
import importlib
import inspect
import os
import re

import pytest

import distrib_tf

ROOT = os.path.dirname(os.path.dirname(__file__))
PAGES = sorted([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md")),
                os.path.join(ROOT, "RELIABILITY.md"), os.path.join(ROOT, "BENCHMARKS.md")])
MARKER = re.compile(r"<!-- (runs in|excerpt of|not run:) (.+?) -->")


def _api_paths() -> list[str]:
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        return re.findall(r"^::: ([\w.]+)$", f.read(), re.M)


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ImportError:
        return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", _api_paths())
def test_every_name_the_api_reference_lists_imports_and_has_a_docstring(path):
    assert inspect.getdoc(_resolve(path)), f"{path} has no docstring"


def test_the_api_reference_lists_every_public_name():
    listed = {path.rpartition(".")[2] for path in _api_paths()}
    public = set(distrib_tf.__all__) | set(distrib_tf.data.__all__)
    assert public - {"data"} <= listed, sorted(public - {"data"} - listed)


def _blocks(page: str):
    """(line number, fence info, code, the marker line before it) of every fenced block."""
    with open(page, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            yield i + 1, lines[i][3:].strip(), lines[i + 1:end], before
            i = end
        i += 1


CASES = [(os.path.relpath(page, ROOT), *block) for page in PAGES for block in _blocks(page)]


@pytest.mark.parametrize("page, line, info, code, before", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_every_code_block_is_run_by_a_test_or_says_why_not(page, line, info, code, before):
    marker = MARKER.search(before)
    assert marker, f"{page}:{line}: a ```{info} block without <!-- runs in FILE::TEST -->, " \
                   "<!-- excerpt of FILE -->, or <!-- not run: REASON --> on the line before it"
    kind, what = marker.groups()
    if kind == "not run:":
        assert len(what.split()) >= 3, f"{page}:{line}: say why in a few words"
        return
    target = what.split()[0]
    path, _, test = target.partition("::")
    assert os.path.exists(os.path.join(ROOT, path)), f"{page}:{line}: {path} does not exist"
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    if test:
        assert re.search(rf"^def {re.escape(test)}\(", text, re.M), f"{page}:{line}: no test {test} in {path}"
    if kind == "excerpt of":  # Every line shown is in the file, in its order ("..." leaves some out).
        at = 0
        for shown in (c.split("  # ")[0].strip() for c in code):  # A comment may be the page's own.
            if shown and shown != "...":
                at = text.find(shown, at)
                assert at >= 0, f"{page}:{line}: {shown!r} is not in {path} (after the lines before it)"


def test_the_blocks_marked_to_run_here_run(tmp_path):
    """The blocks marked `runs in tests/test_docs.py::test_the_blocks_marked_to_run_here_run`,
    each in a fresh interpreter (after `import distrib_tf`, as the guide's reader has it)."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    here = "tests/test_docs.py::test_the_blocks_marked_to_run_here_run"
    ran = 0
    for page, line, _, code, before in CASES:
        if here in before:
            done = subprocess.run([sys.executable, "-c", "import distrib_tf\n" + "\n".join(code)], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
            assert done.returncode == 0, f"{page}:{line}: {done.stderr[-2000:]}"
            ran += 1
    assert ran >= 1


def test_every_public_signature_has_type_hints():
    """Every parameter and return of the functions and methods the API reference lists
    (`py.typed` says the hints are for users)."""
    missing = []
    for path in _api_paths():
        found = _resolve(path)
        if inspect.isclass(found) and issubclass(found, BaseException):
            continue
        functions = [(f"{path}.{name}", f) for name, f in vars(found).items()
                     if callable(f) and (not name.startswith("_") or name == "__init__")] if inspect.isclass(found) \
            else [(path, found)]
        for name, function in functions:
            try:
                signature = inspect.signature(function)
            except (TypeError, ValueError):
                continue
            missing += [f"{name}({p})" for p, parameter in signature.parameters.items()
                        if p not in ("self", "cls") and parameter.annotation is inspect.Parameter.empty
                        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)]
            if signature.return_annotation is inspect.Signature.empty and not name.endswith("__init__"):
                missing.append(f"{name} -> ?")
    assert not missing, missing

"""Deprecated names: aliases checked in a fresh interpreter (a module warns once, on its first
import), and `PageManager`'s deprecated methods called on purpose."""

import contextlib
import subprocess
import sys
import warnings

from easykv.manager.deprecated import DeprecatedMethods

# PageManager's names kept for one release (each warns, then runs its replacement).
DEPRECATED = frozenset(name for name in vars(DeprecatedMethods) if not name.startswith("_"))


def warnings_on_import(imports: str, checks: str) -> list[tuple[str, str, str]]:
    """Run ``imports`` in a new Python recording every warning, then ``checks`` (asserts on the
    imported names); the warnings as (category, message, filename), or AssertionError with the
    child's stderr when anything failed."""
    body = "".join(f"    {line}\n" for line in imports.strip().splitlines())
    code = ("import warnings; warnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n{body}"
            f"{checks.strip()}\n"
            "print(repr([(w.category.__name__, str(w.message), w.filename) for w in seen]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr of str tuples)


@contextlib.contextmanager
def old_name(name: str):
    """Run a call of ``PageManager.name`` on purpose where ``name`` is one of its deprecated methods:
    their own DeprecationWarning is expected there (a call refused before the method runs, by the
    open-plan guard reading its ids, has none, so `pytest.warns` cannot ask for it); every other
    warning goes on. Any other ``name``: nothing is changed."""
    with warnings.catch_warnings():
        if name in DEPRECATED:
            warnings.filterwarnings("ignore", message=rf"PageManager\.{name} is deprecated; use ",
                                    category=DeprecationWarning)
        yield

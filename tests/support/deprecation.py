"""Deprecated aliases checked in a fresh interpreter (a module warns once, on its first import)."""

import subprocess
import sys


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

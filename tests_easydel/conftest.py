"""EasyDeL 0.3 integration tests: 8 simulated CPU devices; every module skips itself where EasyDeL
is not installed (``pip install 'easykv[easydel]'``).

Run: ``. /work/venv-easydel/bin/activate && python -m pytest tests_easydel -q -p no:cacheprovider``
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # helpers.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support

from tests.support.devices import configure  # noqa: E402

configure()  # 8 CPU devices and the tests' compile flags, as in tests/

import jax  # noqa: E402
import pytest  # noqa: E402

# EasyDeL points JAX's persistent compilation cache at ~/.cache when imported; tests compile afresh.
jax.config.update("jax_enable_compilation_cache", False)


def pytest_configure(config):
    # EasyDeL 0.3 on flax 0.12 warns on every Variable.value access; not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:easydel.*")
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:flax.*")


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    from helpers import make_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(str(path))
    return str(path)

"""Tunix (google-tunix 0.1.7) integration tests: 8 simulated CPU devices; every module skips itself
where Tunix is not installed (``pip install 'easykv[tunix,test]'``).

Run: ``python -m pytest tests_tunix -q``
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # helpers.py
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: tests.support

from tests.support.devices import configure  # noqa: E402

configure()  # 8 CPU devices and the tests' compile flags, as in tests/


def pytest_configure(config):
    # Tunix's llama3 and gemma3 fall back to its deprecated cache constructor in its own Sampler.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning:tunix.*")

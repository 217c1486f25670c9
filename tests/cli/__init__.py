"""Tests of the ``easykv`` command line."""

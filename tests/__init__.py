"""easykv's test suite: one folder per package of easykv, shared helpers in ``support``."""

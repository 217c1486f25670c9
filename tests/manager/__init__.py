"""Tests of ``easykv.manager``: the host-side page manager, by exact page ids and state machines."""

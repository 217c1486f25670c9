"""Bridges between easykv and other libraries.

* ``easykv.integrations.easydel``: EasyDeL 0.3 models and its eSurge engine on easykv pages
  (``pip install 'easykv[easydel]'``).

Nothing is imported here: each bridge loads its library only when used.
"""

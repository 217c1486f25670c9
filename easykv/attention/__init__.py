"""Paged attention: queries attending to keys and values read through page tables. ``api``
holds the public entry points (``paged_attention``, ``view_attention``,
``paged_attention_implementation``, ``paged_attention_reference``) and the jitted dispatch that
places the computation over the mesh; ``checks`` checks every shape and dtype of a call, resolves
its options against the pages, has the step metadata checked once against the pool (by the
``step`` package's rules) and chooses the implementation; ``xla`` is the blocked online-softmax
path that runs on every backend, ``pallas`` the TPU decode kernel, ``reference`` the dense
pure-jnp reference the tests compare against; ``options`` holds the keyword options as one checked
value and ``rows`` every metadata form as query rows. They are one unit because they share one
configuration and one way of reading pages, and they read pages and runtime metadata only: the
page manager is never imported here; nothing is imported by this file.
"""

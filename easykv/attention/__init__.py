"""Paged attention: queries attending to keys and values read through page tables. ``api``
holds the entry points and the computation, ``checks`` the validation of every option, shape
and host-side metadata value and a call's static configuration. They read pages and runtime
metadata only: the page manager is never imported here; nothing is imported by this file.
"""

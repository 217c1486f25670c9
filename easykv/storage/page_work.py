"""Device work on whole pages (copy-on-write copies, scrubs, host-tier transfers) in a few shapes.

A jitted program compiles once per shape of its arguments, so work shaped by its count would
compile once per count: a server that scrubs released pages would, over its life, compile one
program for every number of pages a step released, up to the pool. Every call that copies,
zeroes or moves pages therefore pads its page ids to a bucket (`work_bucket`): the next power of
two, capped at the pool's pages, since no more work can be pending than one entry per page. All
the arrays of one call share its bucket, so a program's shapes follow from one number and a pool
of ``P`` pages compiles at most ``ceil(log2 P) + 1`` shapes of it.

Padding is dropped on the device, never clipped into a real page: a -1 id (and any id outside
the shard's slice) becomes one past the slice, which a ``mode="drop"`` scatter skips, and a copy
whose source or destination is padding writes nothing (`copy_pages_local`, `zero_pages_local`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from easykv.storage.pages import PageLayout, PageTree, copy_pages_local, zero_pages_local

# Host-tier transfers move at most this many pages per replica in one call (`HostTier.apply`
# splits larger ones): the staging arrays of a call are ``min(bucket, TRANSFER_CHUNK)`` pages,
# so a call that only copies or zeroes pages stages at most this much, however many it zeroes.
TRANSFER_CHUNK = 64


def work_bucket(n: int, most: int) -> int:
    """The padded length of ``n`` entries of page work on a pool of ``most`` pages: the next
    power of two, at most ``most`` (0 for none). More than ``most`` entries (only a caller's own
    padding or repeats can make that many) round up to a power of two."""
    if n <= 0:
        return 0
    size = 1 << (n - 1).bit_length()
    return min(size, most) if n <= most else size


def padded_ids(ids: ArrayLike, size: int, fill: int = -1) -> np.ndarray:
    """``ids`` (host ints) as an int32 array of ``size`` entries, the rest ``fill``."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    out = np.full(size, fill, np.int32)
    out[: ids.size] = ids
    return out


def page_work_local(pages: PageTree, _: object, src: jax.Array, dst: jax.Array, scrubs: jax.Array, *,
                    layout: PageLayout | None, between: Callable[[PageTree], PageTree] | None = None) -> PageTree:
    """Copy ``src[i] -> dst[i]`` (sources read before destinations are written), then zero
    ``scrubs``, in every layer of every stacked array of ``pages`` (one shard; global ids, -1
    padding). A half with nothing real to do is skipped on the device (``lax.cond``), so a call
    that only zeroes gathers no pages for its padded copies, and the other way round.
    ``between``: work on ``pages`` after the copies and before the zeroing (the host tier's
    onloads)."""
    def copy(p: PageTree) -> PageTree:
        return copy_pages_local(p, None, src, dst, layout=layout)

    def zero(p: PageTree) -> PageTree:
        return zero_pages_local(p, None, scrubs, layout=layout)

    def keep(p: PageTree) -> PageTree:
        return p

    pages = jax.lax.cond(jnp.any((src >= 0) & (dst >= 0)), copy, keep, pages)
    if between is not None:
        pages = between(pages)
    done: PageTree = jax.lax.cond(jnp.any(scrubs >= 0), zero, keep, pages)
    return done


__all__ = ["TRANSFER_CHUNK", "padded_ids", "page_work_local", "work_bucket"]

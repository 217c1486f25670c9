"""The attention tests' pages and step metadata (tiny shapes: head_dim 16, page_size 4, 48
pages, on each page layout) and the dense attention reference written from the definitions in
numpy float64, which every attention test compares against."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from easykv import PagedAttentionMetadata
from easykv.sharding import create_mesh
from easykv.step.metadata import build_mixed, step_form
from easykv.storage.pages import PageLayout

PAGES, PS, D, WIDTH = 48, 4, 16, 6  # pool pages, page size, head dim, page-table columns
GROUP = 4  # q heads per kv head
# Several key blocks. query_block 4: the 6- and 7-row chunks take one full block and go on row
# by row (fewer than 4 left), the 3-row chunk row by row; query_block 8: they take one block
# masked past their end.
BLOCK = dict(pages_per_block=2, query_block=4)
COLLECTIVES = re.compile(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter")

# layout name -> (mesh axes, kv heads, head axes, page axes)
LAYOUTS = {
    "single": (None, 2, (), ()),
    "heads": ({"dp": 1, "tp": 8}, 8, ("tp",), ()),
    "replicated": ({"dp": 1, "tp": 8}, 4, (), ()),
    "dp": ({"dp": 2, "tp": 4}, 8, ("tp",), ("dp",)),
}


@functools.cache
def page_layout(name: str) -> PageLayout | None:
    dims, _, heads, pages = LAYOUTS[name]
    if dims is None:
        return None
    return PageLayout(create_mesh(dims), head_axes=heads, page_axes=pages)


def make_pages(rng, name: str, dtype: str):
    """Random K/V pages (host copies, and device copies placed as the layout says)."""
    heads = LAYOUTS[name][1]
    host = []
    for _ in range(2):
        x = rng.standard_normal((heads, PAGES, PS, D)).astype(np.float32)
        if dtype == "bfloat16":
            x = x.astype(ml_dtypes.bfloat16).view(np.uint16)  # raw bits, as the CPU cache stores them
        host.append(x)
    layout = page_layout(name)
    dev = [jnp.asarray(x) if layout is None else jax.device_put(x, layout.layer_sharding) for x in host]
    return host, dev


def table_rows(rng, name: str, n: int) -> np.ndarray:
    """``n`` page-table rows over a random permutation of the pool; with a split pool, row ``b``
    lives in replica ``b % 2``'s slice of pages."""
    if LAYOUTS[name][3]:
        half = PAGES // 2
        perms = [rng.permutation(half) + r * half for r in range(2)]
        return np.stack([perms[b % 2][(b // 2) * WIDTH : (b // 2 + 1) * WIDTH] for b in range(n)]).astype(np.int32)
    return rng.permutation(PAGES)[: n * WIDTH].reshape(n, WIDTH).astype(np.int32)


def decode_md(rng, name):
    # lengths 1, 4 and 8 (exact page ends), 13, 24 (full table) and a padding row
    pos = np.array([0, 3, 7, 12, 23, -1], np.int32)
    return PagedAttentionMetadata(decodes_position=pos, decodes_page_table=table_rows(rng, name, len(pos)))


def prefill_md(rng, name):
    # a 7-token chunk after a 9-token cached prefix (crosses page ends), padded to 10 rows;
    # table columns past the chunk are unassigned
    row = table_rows(rng, name, 1)[0]
    row[4:] = -1
    pos = np.full(10, -1, np.int32)
    pos[:7] = np.arange(9, 16)
    return PagedAttentionMetadata(prefill_length=np.asarray(7, np.int32), prefill_position=pos, prefill_page_table=row)


def mixed_md(rng, name):
    # a chunk after a prefix, a fresh prefill, two decodes (one at the table's end), 3 padding
    # tokens and 2 padding sequences
    table = table_rows(rng, name, 4)
    return build_mixed(
        table, np.array([5, 0, 11, 23], np.int32), np.array([3, 6, 1, 1], np.int32),
        page_size=PS, pad_tokens_to=14, pad_seqs_to=6,
    )  # fmt: skip


MAKERS = {"decode": decode_md, "prefill": prefill_md, "mixed": mixed_md}


def release_before_window(md, window):
    """Unassign (-1) every page wholly before each sequence's window, as an engine that frees
    pages falling out of a sliding window does: attention must not need them."""
    form = step_form(md)  # a RaggedStep (build_mixed's) is the mixed form
    if form == "decode":
        table, seq, pos = md.decodes_page_table.copy(), np.arange(len(md.decodes_position)), md.decodes_position
    elif form == "prefill":
        table, pos = md.prefill_page_table[None].copy(), md.prefill_position[: md.prefill_length]
        seq = np.zeros(len(pos), int)
    else:
        table, pos = md.page_table.copy(), md.positions
        seq = np.searchsorted(md.query_start_loc[1:], np.arange(len(pos)), side="right")
    for b in range(table.shape[0]):
        mine = pos[(seq == b) & (pos >= 0)]
        if mine.size:
            table[b, : max(int(mine.min()) - window + 1, 0) // PS] = -1
    if form == "decode":
        return md.replace(decodes_page_table=table)
    if form == "prefill":
        return md.replace(prefill_page_table=table[0])
    return md.replace(page_table=table)


def real_rows(md):
    """Which query rows of ``md`` are real tokens (not padding)."""
    form = step_form(md)
    if form == "decode":
        return md.decodes_position >= 0
    if form == "prefill":
        return np.arange(md.prefill_position.shape[0]) < md.prefill_length
    return np.arange(md.positions.shape[0]) < md.query_start_loc[md.num_seqs]


def numpy_attention(q, k, v, pos, *, sinks=None, window=None, chunk=None, scale=None):
    """One sequence, float64, from the definitions: query t at position pos[t] (-1: padding)
    sees keys j <= pos[t] (and j > pos[t] - window, and j in pos[t]'s chunk); a sink joins each
    q head's softmax as a logit with no value. q (T, Hq, Dk); k (L, Hkv, Dk); v (L, Hkv, Dv)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    tokens, hq, dk = q.shape
    group = hq // k.shape[1]
    scale = dk**-0.5 if scale is None else scale
    out = np.zeros((tokens, hq, v.shape[-1]))
    for t in range(tokens):
        p = pos[t]
        if p < 0:
            continue
        j = np.arange(p + 1)
        seen = np.ones(p + 1, bool)
        if window is not None:
            seen &= j > p - window
        if chunk is not None:
            seen &= j >= p - p % chunk
        for h in range(hq):
            s = k[j[seen], h // group] @ q[t, h] * scale
            logits = np.concatenate([s, [sinks[h]]]) if sinks is not None else s
            w = np.exp(logits - logits.max())
            w = w[: s.size] / w.sum()
            out[t, h] = w @ v[j[seen], h // group]
    return out

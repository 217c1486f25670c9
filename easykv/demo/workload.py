"""The demo's requests: byte-level prompts sharing a first sentence, arriving over time, one forked."""

from __future__ import annotations

import numpy as np

from easykv.demo.engine import Request

# The trained demo model (easykv/demo/weights/) learned English from the project's own docs, so
# the prompts are openings of such sentences: a shared first sentence (the "system prompt" every
# request starts with: whole pages of it hit the prefix cache) and a sentence for the model to
# finish. About 120 bytes each, as before (tests size page pools and preemption for that).
SYSTEM_PROMPT = "easykv holds the attention keys and values of many sequences in fixed-size pages. "
OPENINGS = (
    "The page manager hands out pages to each ", "A sliding window layer keeps only the ",
    "Prefix caching lets a new request reuse the ", "A forked sequence shares its pages with the ",
    "Each device holds the kv heads of its ", "The quantizer compresses every page of the ",
    "Continuous batching mixes prefill chunks with ", "A checkpoint saves the cache and the ",
    "The host tier keeps evicted pages in host ", "Copy-on-write copies a shared page when ",
    "Paged attention reads the keys and values ", "The page pool is sized from the memory of ",
)  # fmt: skip


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: one token per UTF-8 byte (vocabulary 256, nothing to download)."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def make_requests(num_requests: int, max_new_tokens: int, *, seed: int, fork: bool = True) -> list[Request]:
    """``num_requests`` prompts (system prompt + an opening) arriving two per step, generation
    lengths between half and all of ``max_new_tokens``; with ``fork`` the last request is a
    parallel sample of the first."""
    rng = np.random.default_rng(seed)
    plain = num_requests - 1 if fork and num_requests > 1 else num_requests
    requests = []
    for i in range(plain):
        prompt = encode(SYSTEM_PROMPT + OPENINGS[i % len(OPENINGS)])
        n = int(rng.integers(max(2, max_new_tokens // 2), max_new_tokens + 1))
        requests.append(Request(rid=i, prompt=prompt, max_new_tokens=n, arrival=i // 2))
    if plain < num_requests:
        first = requests[0]
        requests.append(Request(rid=plain, prompt=list(first.prompt), max_new_tokens=max(2, max_new_tokens // 2),
                                arrival=first.arrival, fork_of=first.rid))  # fmt: skip
    return requests

"""The demo's requests: byte-level prompts sharing a system prompt, arriving over time, one forked."""

from __future__ import annotations

import numpy as np

from easykv.demo.engine import Request

SYSTEM_PROMPT = "System: you are a small model serving from a paged KV cache. Answer briefly.\n"
QUESTIONS = (
    "What is a page table?", "Why share a prefix?", "How big is a page?", "Who owns page 7?",
    "What does copy-on-write copy?", "When is a page evicted?", "Why raw bits on CPU?",
    "What is continuous batching?", "How many heads per device?", "What does a fork share?",
)  # fmt: skip


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: one token per UTF-8 byte (vocabulary 256, nothing to download)."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")


def make_requests(num_requests: int, max_new_tokens: int, *, seed: int, fork: bool = True) -> list[Request]:
    """``num_requests`` prompts (system prompt + a question) arriving two per step, generation
    lengths between half and all of ``max_new_tokens``; with ``fork`` the last request is a
    parallel sample of the first."""
    rng = np.random.default_rng(seed)
    plain = num_requests - 1 if fork and num_requests > 1 else num_requests
    requests = []
    for i in range(plain):
        question = QUESTIONS[i % len(QUESTIONS)]
        prompt = encode(f"{SYSTEM_PROMPT}User {i}: {question}\nAssistant:")
        n = int(rng.integers(max(2, max_new_tokens // 2), max_new_tokens + 1))
        requests.append(Request(rid=i, prompt=prompt, max_new_tokens=n, arrival=i // 2))
    if plain < num_requests:
        first = requests[0]
        requests.append(Request(rid=plain, prompt=list(first.prompt), max_new_tokens=max(2, max_new_tokens // 2),
                                arrival=first.arrival, fork_of=first.rid))  # fmt: skip
    return requests

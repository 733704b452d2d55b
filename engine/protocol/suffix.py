"""Suffix drafts: the token that followed the longest earlier occurrence of the context's suffix
(in the spirit of prompt lookup and SuffixDecoding; training-free, no communication). Pure
logic, no torch.

`SuffixIndex` indexes the n-grams (n <= max_len) of a request's committed history (prompt +
verified tokens) by where they end, keeping the two most recent ends of each. `propose(tail)`
looks up the context's suffix, longest first: `tail` is the whole context in front of the
position to draft (committed tokens, then the unverified in-flight drafts), of which only the
last max_len tokens are read. An occurrence counts when it ends before the tail's own end and
the token after it is known (committed or in flight). Deterministic: the same history gives
the same proposal, which is what makes the exact T=0 replay (train/fast_eval.py) agree with the
runtime. `CrossRequestHistory` optionally adds the prompts and outputs of the process's earlier
requests (a server's), consulted when the request's own history has no match.

With `max_run` > 1 a proposal also carries its run: the tokens that followed the proposed one in
the same occurrence (as far as they are known, at most max_run - 1), which a draft may carry
through the stages as one entry (a suffix run, docs/design.md 3.13).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SEPARATOR = -1  # between requests in a cross-request history: never matched, never proposed


@dataclass(frozen=True)
class SuffixSettings:
    """max_len: longest suffix looked up; min_match: shortest match that proposes a token;
    max_run: tokens one proposal may carry (the proposed one and those after it), 1: no runs."""

    max_len: int = 16
    min_match: int = 2
    max_run: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_len:
            raise ValueError(f"suffix drafts need 1 <= min_match <= max_len, got {self.min_match}, {self.max_len}")
        if self.max_run < 1:
            raise ValueError(f"a suffix run carries at least 1 token, got max_run={self.max_run}")


@dataclass(frozen=True)
class SuffixProposal:
    token: int
    length: int  # tokens of the matched suffix
    run: tuple[int, ...] = ()  # the tokens after `token` in the same occurrence (max_run > 1)


class CrossRequestHistory:
    """Earlier requests' prompts and outputs of this process, bounded: when adding a request
    would pass `max_tokens`, the history starts over with it."""

    def __init__(self, settings: SuffixSettings, max_tokens: int = 1 << 16) -> None:
        self.settings, self.max_tokens = settings, max_tokens
        self.index = SuffixIndex(settings)

    def add(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        if len(self.index.history) + len(prompt) + len(output) + 1 > self.max_tokens:
            self.index = SuffixIndex(self.settings)
        self.index.extend([*prompt, *output, SEPARATOR])

    def propose(self, tail: Sequence[int]) -> SuffixProposal | None:
        return self.index.propose_elsewhere(tail)


class SuffixIndex:
    def __init__(self, settings: SuffixSettings = SuffixSettings()) -> None:
        self.settings = settings
        self.history: list[int] = []  # committed tokens: prompt + verified
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (latest end, previous end)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens (they never roll back)."""
        h, max_len, ends = self.history, self.settings.max_len, self._ends
        for tok in tokens:
            h.append(tok)
            e = len(h) - 1
            window = tuple(h[max(0, e - max_len + 1):])  # every n-gram ending at e is a suffix of it
            for i in range(len(window)):
                key = window[i:]
                last = ends.get(key)
                ends[key] = (e, last[0] if last is not None else -1)

    def propose_elsewhere(self, tail: Sequence[int]) -> SuffixProposal | None:
        """The longest suffix of `tail` (a context this index does not hold: another request's)
        that occurred here, and the token after it; separators (SEPARATOR) are never proposed."""
        h = self.history
        for n in range(min(self.settings.max_len, len(tail)), self.settings.min_match - 1, -1):
            for e in self._ends.get(tuple(tail[len(tail) - n:]), ()):
                if 0 <= e < len(h) - 1 and h[e + 1] != SEPARATOR:
                    run = []
                    for i in range(e + 2, min(e + 1 + self.settings.max_run, len(h))):
                        if h[i] == SEPARATOR:
                            break
                        run.append(h[i])
                    return SuffixProposal(h[e + 1], n, tuple(run))
        return None

    def propose(self, tail: Sequence[int], context_len: int) -> SuffixProposal | None:
        """tail: the last tokens of the context (at least the in-flight ones after the history);
        context_len: the context's length, so tail[-1] sits at index context_len - 1."""
        h = self.history
        inflight = context_len - len(h)  # context = history + the last `inflight` tokens of tail
        assert 0 <= inflight <= len(tail), (inflight, len(tail))
        end = context_len - 1
        top = min(self.settings.max_len, len(tail))
        for n in range(top, self.settings.min_match - 1, -1):
            ends = self._ends.get(tuple(tail[len(tail) - n:]))
            if ends is None:
                continue
            for e in ends:
                if 0 <= e < end:  # an earlier occurrence whose next token is known
                    known = [h[i] if i < len(h) else tail[len(tail) - inflight + (i - len(h))]
                             for i in range(e + 1, min(e + 1 + self.settings.max_run, end + 1))]
                    return SuffixProposal(known[0], n, tuple(known[1:]))
        return None


def context_tail(index: SuffixIndex, unverified: Sequence[int]) -> tuple[list[int], int]:
    """(tail, context length) for `propose`: the committed history's last tokens, then the
    unverified in-flight tokens (oldest first), at least max_len of them."""
    keep = max(index.settings.max_len, len(unverified))
    return (index.history[-keep:] + list(unverified))[-keep:], len(index.history) + len(unverified)

"""A datastore of n-grams: after each n tokens of a corpus, the token that most often came next.

The prompt lookup (``NgramDrafter``) copies spans of the sequence being decoded; this table carries
what a corpus says instead, in the spirit of retrieval-based drafting (REST, He et al., NAACL 2024:
draft the continuations a datastore holds for the current suffix). Built from the training data of a
head, with the target's own argmax as the "next token" where the feature store holds it (what the
target predicted after that context, not what the human wrote), it proposes a few tokens for free:
no draft forward, a dictionary look-up per token.

``chain(seq, k)`` follows the table greedily from the end of ``seq``: the longest stored n-gram
(``orders``, longest first) that ends the sequence gives the next token, which is appended, and so
on, up to ``k`` tokens or until no n-gram matches. ``PromptLookupBranch`` uses it to continue the
best first drafts of a head (``drafters.py``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable, Sequence


class NgramTable:
    """``tables[n][last n tokens] = next token`` for each order ``n`` (longest tried first)."""

    def __init__(self, tables: dict[int, dict[tuple[int, ...], int]]):
        if not tables or any(n < 1 for n in tables):
            raise ValueError(f"an n-gram table needs orders >= 1, got {sorted(tables)}")
        self.tables = tables
        self.orders = sorted(tables, reverse=True)

    @classmethod
    def build(cls, rows: Iterable[tuple[Sequence[int], Sequence[int] | None]], orders: Sequence[int] = (3, 2),
              min_count: int = 1) -> "NgramTable":
        """From ``(tokens, next)`` rows: ``next[i]`` is the token that follows ``tokens[: i + 1]`` (the
        target's argmax at position i), or ``None`` for the corpus's own next token (``tokens[i + 1]``).
        Each n-gram keeps its most frequent next token (the first seen among equals) if it was seen at
        least ``min_count`` times."""
        if not orders or min(orders) < 1:
            raise ValueError(f"n-gram orders must be >= 1, got {list(orders)}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counts: dict[int, defaultdict] = {n: defaultdict(Counter) for n in orders}
        for tokens, nxt in rows:
            tokens = [int(t) for t in tokens]
            if nxt is None:
                nxt = tokens[1:]
            elif len(nxt) != len(tokens):
                raise ValueError(f"a row has {len(tokens)} tokens but {len(nxt)} next tokens")
            for i in range(min(len(nxt), len(tokens))):
                for n in orders:
                    if i + 1 >= n:
                        counts[n][tuple(tokens[i + 1 - n: i + 1])][int(nxt[i])] += 1
        tables = {}
        for n, by_key in counts.items():
            tables[n] = {}
            for key, c in by_key.items():
                tok, cnt = c.most_common(1)[0]
                if cnt >= min_count:
                    tables[n][key] = tok
        return cls(tables)

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def next_token(self, seq: Sequence[int]) -> int | None:
        """The stored next token of the longest n-gram ending ``seq``, or None."""
        for n in self.orders:
            if len(seq) >= n:
                tok = self.tables[n].get(tuple(seq[len(seq) - n:]))
                if tok is not None:
                    return tok
        return None

    def chain(self, seq: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens, each the table's next token after ``seq`` and the tokens chained so far."""
        tail = list(seq[len(seq) - self.orders[0]:]) if len(seq) > self.orders[0] else list(seq)
        out: list[int] = []
        for _ in range(k):
            tok = self.next_token(tail)
            if tok is None:
                break
            out.append(tok)
            tail = tail[1:] + [tok] if len(tail) >= self.orders[0] else tail + [tok]
        return out

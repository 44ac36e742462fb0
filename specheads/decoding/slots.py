"""Bookkeeping of a KV cache that holds committed entries followed by draft-tree scratch entries.

Shared by the target runner (Hugging Face cache) and the EAGLE drafter (its ``KVCache``): the
tensors live in those caches; this class only tracks which slots are valid, each entry's
position, and each scratch entry's ancestors, and says how to keep the accepted entries.

Committed slots may contain *holes* (``valid`` False) when rows of a batch commit different
numbers of entries; they are masked out of attention.
"""

from __future__ import annotations

import torch


class TreeSlots:
    """valid (B, S_c) bool; num_tokens (B,) committed tokens per row (= next position);
    scratch_anc (B, s, s) ancestor-or-self; scratch_pos (B, s); scratch_live (B, s)."""

    def __init__(self, batch_size: int, device: torch.device | str = "cpu"):
        self.batch_size, self.device = batch_size, torch.device(device)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.num_tokens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.clear_scratch()

    @property
    def committed(self) -> int:
        return self.valid.shape[1]

    @property
    def scratch(self) -> int:
        return self.scratch_pos.shape[1]

    def clear_scratch(self) -> None:
        B, dev = self.batch_size, self.device
        self.scratch_anc = torch.zeros(B, 0, 0, dtype=torch.bool, device=dev)
        self.scratch_pos = torch.zeros(B, 0, dtype=torch.long, device=dev)
        self.scratch_live = torch.zeros(B, 0, dtype=torch.bool, device=dev)

    def extend(self, parents: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add q scratch entries. parents (B, q): earlier scratch index or -1 (the committed end);
        live (B, q): real entries. Returns positions (B, q) and the bool mask (B, q, S_c + s + q)."""
        B, q = parents.shape
        if B != self.batch_size:
            raise ValueError(f"parents {tuple(parents.shape)} do not match the batch size {self.batch_size}")
        s = self.scratch
        if q and (parents >= s + torch.arange(q, device=parents.device)).any():
            raise ValueError("a scratch entry names a parent that is not earlier than itself")
        anc = torch.zeros(B, s + q, s + q, dtype=torch.bool, device=self.device)
        anc[:, :s, :s] = self.scratch_anc
        pos = torch.cat([self.scratch_pos, torch.zeros(B, q, dtype=torch.long, device=self.device)], 1)
        rows = torch.arange(B, device=self.device)
        for j in range(q):
            p = parents[:, j]
            has = p >= 0
            pc = p.clamp(min=0)
            anc[:, s + j] = anc[rows, pc] & has[:, None]
            anc[:, s + j, s + j] = True
            pos[:, s + j] = torch.where(has, pos[rows, pc] + 1, self.num_tokens)
        self.scratch_anc, self.scratch_pos = anc, pos
        self.scratch_live = torch.cat([self.scratch_live, live.to(self.device)], 1)
        mask = torch.cat([self.valid[:, None, :].expand(B, q, -1), anc[:, s:, :]], dim=2)
        return pos[:, s:], mask

    def key_positions(self) -> torch.Tensor:
        """(B, S_c + s) position of every cache slot: a committed slot's is the count of valid slots before it
        (holes get the next one's, and are masked anyway), a scratch entry's its tree position."""
        committed = torch.cumsum(self.valid.long(), 1) - self.valid.long()
        return torch.cat([committed, self.scratch_pos], 1)

    def chain_parents(self, lens: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Parents and live flags (B, q) for per-row chains of ``lens`` entries after each row's
        last live scratch entry (or the committed end)."""
        s = self.scratch
        par = torch.full((self.batch_size, q), -1, dtype=torch.long, device=self.device)
        par[:, 1:] = s + torch.arange(q - 1, device=self.device)[None]
        if s:
            ar = torch.arange(s, device=self.device)[None]
            par[:, 0] = torch.where(self.scratch_live, ar, -1).max(1).values
        live = torch.arange(q, device=self.device)[None] < lens.to(self.device)[:, None]
        return par, live

    def commit(self, keep: list[list[int]]) -> tuple[int, torch.Tensor | None]:
        """Keep these scratch entries per row (a root-to-leaf path, in order), drop the rest.

        Returns ``(crop, None)``: drop the last ``crop`` cache slots (every row kept the same
        leading entries), or ``(c, idx)``: replace cache slots ``[c:]`` by the slots ``idx`` (B, m).
        """
        B, s, c = self.batch_size, self.scratch, self.committed
        if len(keep) != B:
            raise ValueError(f"commit got {len(keep)} rows, the batch has {B}")
        for b, k in enumerate(keep):
            if any(not 0 <= i < s for i in k):
                raise ValueError(f"row {b}: commit indices {k} outside the {s} scratch entries")
        m = max((len(k) for k in keep), default=0)
        lens = torch.tensor([len(k) for k in keep], device=self.device)
        self.valid = torch.cat([self.valid, torch.arange(m, device=self.device)[None] < lens[:, None]], 1)
        self.num_tokens = self.num_tokens + lens
        self.clear_scratch()
        if all(list(k) == list(range(m)) for k in keep):
            return s - m, None
        idx = torch.tensor([list(k) + [0] * (m - len(k)) for k in keep], dtype=torch.long, device=self.device)
        return c, idx + c

    def truncate(self, committed: int) -> None:
        """Keep the first ``committed`` committed slots of every row and no scratch entry (back to an earlier
        committed context, as if what followed had never been fed)."""
        if not 0 <= committed <= self.committed:
            raise ValueError(f"cannot truncate {self.committed} committed slots to {committed}")
        self.valid = self.valid[:, :committed]
        self.num_tokens = self.valid.sum(1)
        self.clear_scratch()

    def discard(self) -> int:
        """Drop all scratch entries; returns how many cache slots to crop."""
        s = self.scratch
        self.clear_scratch()
        return s

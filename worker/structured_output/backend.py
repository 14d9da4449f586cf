"""The interface a grammar library implements to constrain decoding (xgrammar today).

A backend turns `StructuredOutputsParams` into a compiled grammar (slow, run off the step loop,
shared by every request with the same constraint) and a compiled grammar into one matcher per
sequence (cheap, holds that sequence's position in the grammar). Each step, every constrained
sequence that samples fills its row of a token bitmask (bit set: token allowed) and the rows are
applied to the logits before sampling; unconstrained rows are never touched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvscale.worker.sample.sampling_params import StructuredOutputsParams


class StructuredOutputGrammar(ABC):
    """One sequence's matcher: where it stands in its grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False (state unchanged) when the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculation walks proposals, then returns)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""


class StructuredOutputBackend(ABC):
    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ValueError, saying why, for a constraint over its budget (budget.py) or one this
        backend cannot enforce exactly (a JSON schema keyword it would silently ignore). Cheap and
        without parsing the grammar: called before the request is queued."""

    @abstractmethod
    def parse(self, params: StructuredOutputsParams) -> object:
        """The constraint parsed (opaque); ValueError, saying why, for a malformed one."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams, parsed: object = None) -> object:
        """The compiled grammar (opaque) of `parsed` (parse(params) when None); ValueError for a
        malformed constraint. Slow, thread-safe, called from a pool thread."""

    def memory_size_bytes(self, compiled: object) -> int:
        """What a compiled grammar holds in memory (the compile cache's byte budget)."""
        return 0

    @abstractmethod
    def new_matcher(self, compiled: object) -> StructuredOutputGrammar:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A host bitmask with room for `num_rows` rows over the model's vocabulary."""

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """In place: forbid (-inf) in each row of `rows` the tokens not set in the same row of
        `bitmask`; other rows stay exactly as they are. `logits` may live on any device."""

"""One sequence's structured-output state: its grammar (compiling, or compiled) and its matcher."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.backend import StructuredOutputGrammar


class StructuredOutputRequest:
    """The compiled grammar is shared (a future from the manager's compile cache); the matcher is
    this sequence's own, made when the grammar is first needed after it is ready."""

    def __init__(
        self,
        params: StructuredOutputsParams,
        compiled: Future,
        new_matcher: Callable[[object], StructuredOutputGrammar],
    ) -> None:
        self.params = params
        self.compiled = compiled
        self._new_matcher = new_matcher
        self._matcher: StructuredOutputGrammar | None = None

    def is_ready(self) -> bool:
        """The compile finished (successfully or not): the request may leave WAITING_FOR_GRAMMAR."""
        return self.compiled.done()

    def error(self) -> BaseException | None:
        """Why the compile failed, once it has; None while compiling or after success."""
        return self.compiled.exception() if self.compiled.done() else None

    @property
    def matcher(self) -> StructuredOutputGrammar:
        """Only once ready without error."""
        if self._matcher is None:
            self._matcher = self._new_matcher(self.compiled.result())
        return self._matcher

"""One sequence's structured-output state: its grammar (compiling, or compiled) and its matcher."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.structured_output.backend import StructuredOutputGrammar


class GrammarCompileTimeout(TimeoutError):
    """A request's grammar did not compile within its deadline (the compile itself runs on)."""


class StructuredOutputRequest:
    """The compiled grammar is shared (a future from the manager's compile cache); the matcher is
    this sequence's own, made when the grammar is first needed after it is ready."""

    def __init__(
        self,
        params: StructuredOutputsParams,
        compiled: Future,
        new_matcher: Callable[[object], StructuredOutputGrammar],
        deadline: float | None = None,
    ) -> None:
        self.params = params
        self.compiled = compiled
        # time.monotonic() by which the compile must be done (None: no bound; the server waits for
        # its compiles, with their own deadline, before a request reaches the scheduler).
        self.deadline = deadline
        self._new_matcher = new_matcher
        self._matcher: StructuredOutputGrammar | None = None
        self._timed_out: GrammarCompileTimeout | None = None

    def is_ready(self) -> bool:
        """The compile finished (successfully or not): the request may leave WAITING_FOR_GRAMMAR."""
        return self.compiled.done()

    def expired(self, now: float) -> bool:
        """Still compiling at its deadline: the request gives up (error() says so); the compile,
        shared through the cache, runs on for later requests."""
        if self.deadline is None or self.compiled.done() or now < self.deadline:
            return False
        self._timed_out = GrammarCompileTimeout(
            "the grammar did not compile within grammar_compile_timeout; it is cached if it "
            "completes, so a retry may succeed"
        )
        return True

    def error(self) -> BaseException | None:
        """Why the compile failed (or timed out), once it has; None while compiling or after success."""
        if self._timed_out is not None:
            return self._timed_out
        return self.compiled.exception() if self.compiled.done() else None

    @property
    def matcher(self) -> StructuredOutputGrammar:
        """Only once ready without error."""
        if self._matcher is None:
            self._matcher = self._new_matcher(self.compiled.result())
        return self._matcher

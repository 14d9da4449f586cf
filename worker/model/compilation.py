"""The compiled forward on CPU: `torch.compile` (inductor, C++ wrapper) of the model's per-token
work, so that a decode step costs its matrix products rather than ~1,400 eager ops (issue 19).

What compiles is `LlamaForCausalLM.forward_tokens`: embedding, norms, projections, RoPE and the MLP,
fused by inductor into a few C++ loops around the matmuls. Attention stays an opaque op
(attention/unified_attention.py) that reaches the step's plan through the forward context, so
the graph depends on the number of tokens alone. Decode-only steps (every sequence one new
token: the steady state) go further: attention runs inside the graph too
(`LlamaForCausalLM.forward_decode`, kernels/paged_attention.py's `paged_decode_attention_unwritten`,
which inductor turns into one loop nest per layer reading the paged cache in place), with no Python
between layers, and the step's keys and values are cached after it. It computes every sequence
over the longest one's blocks, so a step whose lengths spread too far (`forward_batch.in_graph_decode`)
keeps the backend's length buckets. Three graphs cover every step, all compiled at start-up
(`warm_up`), never on a request's time:

- decode-only with attention in the graph: 1 token (one stream, static shapes), and 2 or more
  (dynamic batch and context length);
- everything else (prefill chunks, speculative verification, decodes of spread-out lengths):
  2 or more tokens, dynamic.

After warm-up the dispatch runs with dynamo's guard checks cut to those that tell the graphs apart
(`skip_guard_eval_unsafe`: the full checks cost ~1 ms per call on this model) and recompiling is
refused: a step no graph covers runs eagerly instead of stalling every request on a compile.

Not compiled: CUDA (CUDA graphs do this job there), tensor parallelism (the collectives inside the
graph are untested), `enforce_eager`, machines without a C++ compiler (inductor needs one; the worker
image has g++ for it), and a cache directory where inductor cannot write or load the libraries it
builds (e.g. docker's `--tmpfs /tmp` without `exec`): docs/engine.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch

logger = logging.getLogger(__name__)

# Token counts compiled at start-up: one per graph (see the module docstring).
WARM_UP_TOKENS = (1, 2)


def inductor_cxx() -> str:
    """The C++ compiler inductor will call."""
    import torch._inductor.config

    return torch._inductor.config.cpp.cxx[1] or "g++"


def cache_dir_problem(cache_dir: str | None = None) -> str | None:
    """Why inductor's cache directory (default: its own choice) cannot hold the compiled forward, or
    None. Inductor loads the libraries it builds from there, so it must be writable and not noexec;
    checked up front, a minute of compiling is not wasted on a dlopen that fails."""
    if cache_dir is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        return f"inductor's cache directory {cache_dir} cannot be made ({e.strerror})"
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        return f"inductor's cache directory {cache_dir} is not writable"
    if os.statvfs(cache_dir).f_flag & os.ST_NOEXEC:
        return (
            f"inductor's cache directory {cache_dir} is on a noexec mount (docker: --tmpfs /tmp:exec, "
            "or TORCHINDUCTOR_CACHE_DIR elsewhere)"
        )
    return None


def compile_decision(
    device: torch.device,
    tensor_parallel: bool,
    enforce_eager: bool,
    attention_backend: str = "torch",
    cxx: str | None = None,
    cache_dir: str | None = None,
) -> str | None:
    """None when the forward should compile, else why it runs eagerly. cxx: inductor's compiler;
    cache_dir: its cache directory."""
    if enforce_eager:
        return "enforce_eager is set"
    if device.type != "cpu":
        return f"compiled forward is for CPUs (on {device.type}, CUDA graphs cover decode steps)"
    if attention_backend != "torch":  # its decode path would bypass the backend being asked for
        return f"the {attention_backend} attention backend runs eagerly"
    if tensor_parallel:
        return "not under tensor parallelism (collectives in the graph are untested)"
    cxx = cxx or inductor_cxx()
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH): inductor needs one"
    return cache_dir_problem(cache_dir)


class CompiledForward:
    """`forward_tokens(input_ids, positions, decode)` compiled; call `warm_up` once before serving."""

    def __init__(self, forward_tokens) -> None:
        # dynamo caches graphs per function, not per model: every model of this class in the process
        # (the tests build dozens, 5 graphs each) shares forward_tokens' cache, by default 8 graphs.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        self.eager = forward_tokens
        # Inductor's own loops (norms, RoPE, SiLU, decode attention) take torch's threads: with decode
        # attention in the graph, a second thread is worth waking even at one stream (measured: 2.6
        # against 2.7 ms a step at 300 tokens of context, 2.9 against 3.5 at 1,000; at 32 streams of
        # 300 tokens, 19 against 31 ms).
        self.compiled = torch.compile(forward_tokens, fullgraph=True, options={"cpp_wrapper": True})
        self.ready = False
        self.eager_fallbacks = 0  # steps no compiled graph covered (should stay 0)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, decode=None):
        many = input_ids.shape[0] > 1
        if many:  # one graph for all sizes above 1, not one per size
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        if decode is not None:  # any context length (and any batch above 1): one graph
            torch._dynamo.mark_dynamic(decode.block_tables, 1)
            if many:
                torch._dynamo.mark_dynamic(decode.block_tables, 0)
                torch._dynamo.mark_dynamic(decode.seq_lens, 0)
        if not self.ready:
            return self.compiled(input_ids, positions, decode)
        try:
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                return self.compiled(input_ids, positions, decode)
        except RuntimeError as e:
            if "recompil" not in str(e).lower():
                raise
            self.eager_fallbacks += 1
            logger.warning(
                "a step of %d tokens matched no compiled graph; it runs eagerly", input_ids.shape[0]
            )
            return self.eager(input_ids, positions, decode)

    def warm_up(self, run_tokens) -> float:
        """Compiles every graph; run_tokens(n, decode) runs one forward of n tokens through this:
        n decodes (attention in the graph) or one chunk of n (attention as the opaque op, the path
        of every step with a longer chunk). Returns the seconds it took."""
        start = time.perf_counter()
        for n in WARM_UP_TOKENS:
            run_tokens(n, True)
            if n > 1:  # a 1-token chunk is a decode: no 1-token graph of the other kind is needed
                run_tokens(n, False)
        self.ready = True
        return time.perf_counter() - start

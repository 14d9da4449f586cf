"""The compiled forward on CPU: the model's per-token work compiled ahead of time by AOTInductor, so
that a decode step costs its matrix products rather than ~1,400 eager ops (issue 19), and served
first, compiled behind (issue 29): a worker never waits for a compile to serve.

What compiles is `LlamaForCausalLM.forward_tokens`: embedding, norms, projections, RoPE and the MLP,
fused by inductor into a few C++ loops around the matmuls. Attention stays an opaque op
(attention/unified_attention.py) that reaches the step's plan through the forward context, so
the graph depends on the number of tokens alone. Decode-only steps (every sequence one new
token: the steady state) go further: attention runs inside the graph too
(`LlamaForCausalLM.forward_decode`, kernels/paged_attention.py's `paged_decode_attention_unwritten`,
which inductor turns into one loop nest per layer reading the paged cache in place), with no Python
between layers, and the graph writes the step's keys and values into the cache after every layer
has read it. It computes every sequence over the longest one's blocks, so a step whose lengths
spread too far (`forward_batch.in_graph_decode`) keeps the backend's length buckets. Four graphs
cover every step (aot_package.py builds them):

- decode-only with attention and the LM head in the graph: 1 token (one stream, static shapes),
  2 to 8, and 9 or more (dynamic batch, context length and pool size). Each has the products that
  are fastest for its rows on a CPU (layers/linear.py);
- everything else (prefill chunks, speculative verification, decodes of spread-out lengths):
  2 or more tokens, dynamic.

A step no graph covers (a lone 1-token chunk that is not a decode) runs eagerly and is counted.

With `--enable-lora` the package has two more graphs, the decode-only one and the chunk one again
with the adapters' products packed inside (aot_package.py's decode_lora and chunk_lora), for steps
whose rows mix adapters and the base model. A step whose adapter rows would not pack without too
much padding (kernels/lora.pack_rows: a long prefill chunk beside a few rows of another adapter)
runs eagerly.

Start-up (ModelRunner): a package for this model, dtype, block size, torch and CPU found in the
compile cache or shipped with the installation is loaded before Ready (a fraction of a second);
otherwise the worker turns Ready on the eager forward and `kvscale-worker compile` builds the
package in a child process (compile_behind.py) at the niceness `compile_nice`; once it is loaded
the engine thread installs it between two steps (ModelRunner.forward), never inside one.

Not compiled: CUDA (CUDA graphs do this job there), tensor parallelism (the collectives inside the
graph are untested), `enforce_eager`, machines without a C++ compiler (inductor needs one to build
a package; the worker image has g++ for it), and a cache directory where inductor cannot write or
load the libraries it builds (e.g. docker's `--tmpfs /tmp` without `exec`): docs/engine.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import weakref

import torch

from kvscale.worker.model.aot_package import LORA_GRAPHS
from kvscale.worker.model.layers.linear import SMALL_ROWS

logger = logging.getLogger(__name__)


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


def decode_graph(num_seqs: int) -> str:
    """The base-model graph of a decode-only step of num_seqs sequences."""
    if num_seqs == 1:
        return "decode1"
    return "decode_small" if num_seqs <= SMALL_ROWS[1] else "decoden"


class CompiledForward:
    """`forward_tokens(input_ids, positions, decode)` through a package's AOTInductor runners
    (aot_package.load_package); the model's rotary tables are passed in on every call. With
    `decode`, what comes back is every row's logits (the LM head runs inside the decode graphs),
    not hidden states, and the step's keys and values are in the cache (the graphs write them);
    the rows' argmax, which the graphs compute too, is kept for `argmax_of`."""

    def __init__(self, model, runners: dict) -> None:
        self.model = model
        self.runners = runners
        self.eager_fallbacks = 0  # steps no compiled graph covered (should stay 0)
        self.lora_steps = 0  # decode steps with adapter rows on the LoRA graph
        # (the logits, weakly: a large vocabulary's rows are not kept past their step; their argmax)
        self._last_decode: tuple[weakref.ref, torch.Tensor] | None = None

    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of `logits` (the first maximum, as torch's), when they are the last
        decode graph's output as it returned them; else None."""
        last = self._last_decode
        return last[1] if last is not None and last[0]() is logits else None

    @property
    def serves_lora(self) -> bool:
        return all(g in self.runners for g in LORA_GRAPHS)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, decode=None, lora=None):
        """lora: LoRASlotTable.graph_inputs' tensors, for a step with adapter rows."""
        model = self.model
        n = input_ids.shape[0]
        if decode is not None:
            inputs = [
                input_ids,
                positions,
                model.rope_cos,
                model.rope_sin,
                decode.block_tables,
                decode.seq_lens,
                decode.slot_mapping,
            ]
            for k, v in decode.kv_caches:
                inputs += (k, v)
            if lora is not None:
                self.lora_steps += 1
                out = self.runners["decode_lora"].boxed_run(inputs + lora)
            else:
                out = self.runners[decode_graph(n)].boxed_run(inputs)
            self._last_decode = (weakref.ref(out[0]), out[1])
            return out[0]
        if lora is not None:
            self.lora_steps += 1
            return self.runners["chunk_lora"].boxed_run(
                [input_ids, positions, model.rope_cos, model.rope_sin, *lora]
            )[0]
        if n < 2:
            self.eager_fallbacks += 1
            logger.warning("a step of %d tokens matched no compiled graph; it runs eagerly", n)
            return model.forward_tokens(input_ids, positions)
        return self.runners["chunk"].boxed_run([input_ids, positions, model.rope_cos, model.rope_sin])[0]

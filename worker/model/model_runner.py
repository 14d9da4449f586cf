"""Owns the model and the KV tensors; turns one SchedulerOutput into one forward pass and samples.

Every scheduled request is one chunk of the flat batch (forward_batch.py): a decode's new token, a
prefill chunk, or a decode's token followed by its proposed tokens, verified in the same forward.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kvscale.worker.config import EngineArgs, fit_max_model_len
from kvscale.worker.core.scheduler import SchedulerOutput
from kvscale.worker.distributed.communication_op import gather_objects, min_over_ranks
from kvscale.worker.distributed.step_broadcast import broadcast_step
from kvscale.worker.lora.manager import LoRAManager
from kvscale.worker.model.aot_package import (
    SHIPPED_DIR,
    PackageRefused,
    artefact_key,
    default_cache_dir,
    find_package,
    load_package,
    private_cache_dir,
    unwritable,
)
from kvscale.worker.model.attention.backend import CommonAttentionMetadata
from kvscale.worker.model.attention.selector import get_attention_backend
from kvscale.worker.model.compilation import CompiledForward, compile_decision
from kvscale.worker.model.compile_behind import BackgroundCompile, compile_command
from kvscale.worker.model.cuda_graphs import CUDAGraphRunner
from kvscale.worker.model.forward_batch import SeqChunk, TokenFill, forward_logits
from kvscale.worker.model.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    free_memory_bytes,
    num_blocks_for,
)
from kvscale.worker.model.layers.rope import max_rope_positions
from kvscale.worker.model.loader import load_config, load_model, resolve_dtype
from kvscale.worker.sample.logprobs import TokenLogprobs
from kvscale.worker.sample.rejection_sampler import RejectionSampler, SpecDecodeRow
from kvscale.worker.sample.sampler import (
    PenaltyState,
    PendingTokens,
    Sampler,
    SamplingMetadata,
    argmax_rows,
    plain_greedy,
    prompt_logprobs,
)

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    return device


def resolve_max_model_len(requested: int | None, hf_config) -> int:
    """The model length: as asked, or by default the longest the RoPE configuration supports
    (rope.max_rope_positions). Longer than that is refused: positions past it run, but the model
    was never made for them and its outputs are silently wrong."""
    limit, reason = max_rope_positions(hf_config)
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
        return limit
    if limit is not None and requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds what the model's RoPE supports: {limit} ({reason})"
        )
    return requested


def pending_tokens(
    plain: list[int], fill_chunks: list[int], token_fill: TokenFill | None
) -> PendingTokens | None:
    """The plain rows (indices into `plain`) whose last token is pending, with those tokens (on the
    device, from the step in flight): for the penalties' counts."""
    if token_fill is None:
        return None
    where = {i: j for j, i in enumerate(fill_chunks)}
    rows = [k for k, i in enumerate(plain) if i in where]
    if not rows:
        return None
    tokens = token_fill[1]
    picked = torch.tensor([where[plain[k]] for k in rows], dtype=torch.int64).to(tokens.device)
    return rows, tokens[picked]


@dataclass
class ModelRunnerOutput:
    # Aligned with SchedulerOutput.requests; empty for prefill chunks that do not end the prompt.
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    # Per request index: (prompt position, logprobs of the prompt token there), for the requests
    # that asked for prompt logprobs and computed part of their prompt in this step.
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device (ModelRunner.launch)."""

    num_requests: int
    plain: list[int]  # requests that sampled one token, in the order of plain_tokens
    spec: list[int]  # requests whose proposals were verified, in the order of spec_token_ids
    plain_tokens: torch.Tensor | None = None  # on the host once `ready` has fired
    ready: torch.cuda.Event | None = None  # the copy of plain_tokens to the host (CUDA only)
    plain_logprobs: list[TokenLogprobs | None] | None = None
    spec_token_ids: list[list[int]] = field(default_factory=list)
    spec_logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    prompt_logprobs: dict[int, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)

    def get(self) -> ModelRunnerOutput:
        """Wait for the step's tokens (the host's only wait on the device per step)."""
        sampled: list[list[int]] = [[] for _ in range(self.num_requests)]
        logprobs: list[list[TokenLogprobs] | None] = [None] * self.num_requests
        if self.plain:
            if self.ready is not None:
                self.ready.synchronize()
            assert self.plain_tokens is not None
            lps = self.plain_logprobs
            for k, (i, token_id) in enumerate(zip(self.plain, self.plain_tokens.tolist(), strict=True)):
                sampled[i] = [token_id]
                if lps is not None and lps[k] is not None:
                    logprobs[i] = [lps[k]]
        for k, i in enumerate(self.spec):
            sampled[i] = self.spec_token_ids[k]
            logprobs[i] = self.spec_logprobs[k]
        return ModelRunnerOutput(sampled, logprobs, self.prompt_logprobs)


class ModelRunner:
    def __init__(self, args: EngineArgs, load_draft=None, tp=None) -> None:
        """load_draft(device, dtype, max_model_len, vocab_size), when given, loads a draft model whose
        KV blocks mirror the target's; it is loaded before the KV cache is sized, which counts its
        bytes per block too. tp (a TensorParallelGroup) makes this one rank of a tensor-parallel
        group: rank 0's forward() first broadcasts its inputs, the other ranks run forward_step()."""
        self.tp = tp
        self.device = resolve_device(args.device) if tp is None else tp.device
        self.hf_config = load_config(args.model)
        self.dtype = resolve_dtype(args.dtype, self.hf_config, self.device)
        self.max_model_len = resolve_max_model_len(args.max_model_len, self.hf_config)
        self.block_size = args.block_size
        torch.manual_seed(args.seed)
        self.model = load_model(args.model, self.hf_config, self.max_model_len, self.device, self.dtype, tp)
        self.spec = self.model.spec
        # What this rank's KV cache holds: its own KV heads only.
        self.kv_spec = replace(self.spec, num_kv_heads=self.model.layout.num_kv_heads)
        self.backend = get_attention_backend(args.attention_backend, self.device)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        # Output token counts for penalties, kept on the device and updated with new tokens only.
        self.penalty_state = PenaltyState(self.spec.vocab_size, self.device)
        # Async scheduling: the last launch's sampled tokens, on the device, and each request's row
        # in them; the next launch feeds them in (launch).
        self._last_sampled_tokens: torch.Tensor | None = None
        self._last_sampled_rows: dict[str, int] = {}
        self.draft = (
            load_draft(self.device, self.dtype, self.max_model_len, self.spec.vocab_size)
            if load_draft
            else None
        )
        if self.draft is not None:
            self.draft.penalty_state = self.penalty_state
        # LoRA adapters' device slots, allocated before the KV cache is sized (which counts them).
        self.lora: LoRAManager | None = None
        if args.enable_lora:
            self.lora = LoRAManager(
                self.spec, args.max_loras, args.max_lora_rank, args.max_cpu_loras, self.device, self.dtype
            )
            logger.info(
                "LoRA: %d slots of rank %d (%.1f MiB), %d adapters in host memory",
                args.max_loras, args.max_lora_rank, self.lora.table.nbytes / 2**20, args.max_cpu_loras,
            )  # fmt: skip
        self.num_blocks = self._size_kv_cache(args)
        self.max_model_len = fit_max_model_len(
            self.max_model_len, self.num_blocks, self.block_size, explicit=args.max_model_len is not None
        )
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        kv_bytes = sum(t.numel() * t.element_size() for kv in self.kv_caches for t in kv)
        # Every rank's KV cache bytes, rank by rank (reported; each is 1/tp of one rank's at tp=1).
        self.kv_cache_bytes_per_rank = [kv_bytes] if tp is None else gather_objects(kv_bytes, tp)
        if self.draft is not None:
            self.draft.allocate_kv_cache(self.num_blocks)
        # Decode-only steps replay captured CUDA graphs (CUDA + Triton backend only; None elsewhere).
        # Not yet under tensor parallelism: capturing the collectives is untested (docs/parallelism.md).
        self.cuda_graphs = (
            CUDAGraphRunner.maybe_create(self, args.max_num_seqs)
            if tp is None and not args.enforce_eager
            else None
        )
        # The compiled CPU forward (model/compilation.py): loaded here when a package exists, else
        # built behind (compile_behind.py) while the eager forward serves, and installed by forward().
        self.compile_seconds: float | None = None  # start-up seconds spent on it before serving
        self.compiler: BackgroundCompile | None = None
        self.switched_at: float | None = None  # time.monotonic() of the switch to compiled steps
        self.compiler_seconds: float | None = None  # the build behind's seconds, once installed
        self._serving_threads: int | None = None  # torch's threads, while the build has one core
        self._maybe_compile(args)

    def _maybe_compile(self, args: EngineArgs) -> None:
        reason = compile_decision(self.device, self.tp is not None, args.enforce_eager, self.backend.name)
        if reason is not None:
            logger.info("eager forward: %s", reason)
            return
        cache_dir = Path(args.compile_cache_dir) if args.compile_cache_dir else default_cache_dir()
        private = private_cache_dir()
        problem = unwritable(cache_dir)
        key = artefact_key(self.spec, self.dtype, self.block_size, args.enable_lora)
        # The private cache is where this worker builds when the compile cache is read-only, so it
        # is searched only then (a container restarted in the same pod finds its own build): with
        # a writable cache, a package left there by other runs must not stand in for the cache's.
        searched = [cache_dir, *([private] if problem is not None else []), SHIPPED_DIR]
        folder = find_package(key, list(dict.fromkeys(searched)))
        if folder is not None:
            started = time.monotonic()
            try:
                self.model.compiled = self._load_package(folder)
            except PackageRefused as e:
                logger.warning("refusing the compiled package %s; compiling anew", e)
            except Exception:
                logger.warning(
                    "the compiled package %s could not be loaded; compiling anew", folder, exc_info=True
                )
            else:
                self.compile_seconds = time.monotonic() - started
                self.switched_at = time.monotonic()
                logger.info("loaded the compiled forward from %s in %.2f s", folder, self.compile_seconds)
                return
        if problem is not None:
            # A compile cache mounted read-only (filled beforehand) without this CPU's package.
            if private == cache_dir or unwritable(private) is not None:
                why = f"the compile cache {cache_dir} {problem}"
                why += "" if private == cache_dir else f", and {private} {unwritable(private)}"
                logger.warning("eager forward: %s", why)
                return
            logger.warning(
                "the compile cache %s %s: the compiled forward is built into %s, for this worker alone",
                cache_dir, problem, private,
            )  # fmt: skip
            cache_dir = private
        dtype = str(self.dtype).removeprefix("torch.")
        command = compile_command(
            args.model, dtype, self.block_size, cache_dir, args.compile_nice, args.enable_lora
        )
        logger.info(
            "serving with the eager forward while the compiled one is built (kvscale-worker compile, "
            "nice %d, into %s; later starts load it)", args.compile_nice, cache_dir,
        )  # fmt: skip
        self.compiler = BackgroundCompile(command, self._load_package)
        if args.compile_reserve_core and args.compile_in_background and torch.get_num_threads() > 1:
            self._serving_threads = torch.get_num_threads()  # given back by maybe_switch
            torch.set_num_threads(self._serving_threads - 1)
        if not args.compile_in_background:
            self.compiler.wait()
            self.maybe_switch()
            self.compile_seconds = self.compiler_seconds

    def _load_package(self, folder: Path) -> CompiledForward:
        runners = load_package(folder, self.model, self.dtype, self.block_size, self.lora is not None)
        return CompiledForward(self.model, runners)

    def maybe_switch(self) -> None:
        """Install the compiled forward built behind, if it is ready: called by the engine thread
        before a forward (and while idle), so that a step runs one forward from its start to its end."""
        compiler = self.compiler
        if compiler is None or not compiler.done.is_set():
            return
        self.compiler = None
        self._give_back_core()
        if compiler.result is None:
            return  # the build failed (logged): the forward stays eager
        self.model.compiled = compiler.result
        self.compiler_seconds = compiler.seconds
        self.switched_at = time.monotonic()
        logger.info("compiled the forward in %.1f s; steps switch to it", compiler.seconds)

    @property
    def forward_kind(self) -> str:
        """Which forward the next step runs: compiled or eager."""
        return "eager" if getattr(self.model, "compiled", None) is None else "compiled"

    def stop_compile(self) -> None:
        """End a build still running (the worker is going away), and give its core back: the thread
        count is the process's, and an engine made after this one (offline, in tests, in the
        benchmarks) would otherwise run on one thread fewer, or with another OpenMP team size than
        threads it starts (a graph's reductions then split differently)."""
        if self.compiler is not None:
            self.compiler.stop()
        self._give_back_core()

    def _give_back_core(self) -> None:
        """The core a build behind reserved comes back to serving."""
        if self._serving_threads is not None:
            torch.set_num_threads(self._serving_threads)
            self._serving_threads = None

    # -- KV cache ----------------------------------------------------------------------------
    def _size_kv_cache(self, args: EngineArgs) -> int:
        spec = self.kv_spec
        block_bytes = bytes_per_block(
            spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim, self.dtype
        ) + (self.draft.block_bytes() if self.draft is not None else 0)
        reserve = self._profile_activation_bytes(args) if self.device.type == "cuda" else 0
        num_blocks = num_blocks_for(
            block_bytes=block_bytes,
            device_type=self.device.type,
            free_bytes=free_memory_bytes(self.device),
            activation_reserve=reserve,
            max_useful_blocks=args.max_num_seqs * -(-self.max_model_len // self.block_size),
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        )
        if self.tp is not None:  # the pool every rank can hold (rank 0 may also hold a draft's KV)
            num_blocks = min_over_ranks(num_blocks, self.tp)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens)",
            num_blocks, self.block_size, num_blocks * block_bytes / 2**20, num_blocks * self.block_size,
        )  # fmt: skip
        return num_blocks

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return allocate_kv_cache(self.kv_spec, num_blocks, self.block_size, self.dtype, self.device)

    def _profile_activation_bytes(self, args: EngineArgs) -> int:
        """Peak memory of the largest step (one full-budget prefill), measured with a scratch cache."""
        n = min(args.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        self.kv_caches = self._allocate_kv_cache(blocks)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)
        common = CommonAttentionMetadata(
            slot_mapping=positions,
            query_start_loc=torch.tensor([0, n]),
            seq_lens=torch.tensor([n]),
            block_tables=torch.arange(blocks, device=self.device)[None, :],
            num_decodes=0,
            block_size=self.block_size,
        )
        with torch.inference_mode():
            hidden = self.model(tokens, positions, self.kv_caches, self.backend, self.backend.prepare(common))
            self.model.compute_logits(hidden[-min(n, args.max_num_seqs) :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return int(peak * 1.1)

    # -- one step ----------------------------------------------------------------------------
    def forward(
        self, chunks: list[SeqChunk], num_logits: list[int], token_fill: TokenFill | None = None
    ) -> torch.Tensor:
        """Logits of the last num_logits[i] tokens of each chunk, chunk after chunk. On rank 0 of a
        tensor-parallel group the other ranks get the same inputs first and run the same forward
        (never with a token_fill: async scheduling is off under tensor parallelism)."""
        if self.compiler is not None:
            self.maybe_switch()
        if self.tp is not None:
            assert token_fill is None, "the ranks have no device copy of the pending tokens"
            broadcast_step(self.tp, (chunks, num_logits))
        return self.forward_step(chunks, num_logits, token_fill)

    def forward_step(
        self, chunks: list[SeqChunk], num_logits: list[int], token_fill: TokenFill | None = None
    ) -> torch.Tensor | None:
        """This rank's share of one forward (None: logits live on rank 0)."""
        return forward_logits(
            self.model, self.backend, self.kv_caches, chunks, num_logits, self.block_size, self.device,
            self.cuda_graphs, token_fill, self.lora.table if self.lora is not None else None,
        )  # fmt: skip

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Queue the step's forward and sampling on the device; the tokens come from get(). A step
        scheduled asynchronously feeds each request's pending token from the previous launch's
        sampled tokens, which never leave the device for it."""
        chunks, num_logits = [], []
        plain: list[int] = []  # requests that sample one token
        spec: list[int] = []  # requests whose proposals are verified
        fill_chunks: list[int] = []  # chunks whose last token is pending (async scheduling)
        fill_rows: list[int] = []  # ... and its row in the previous launch's sampled tokens
        prompt_rows: list[int] = []  # prefill chunks whose every row's logits are wanted
        lora_slots = [-1] * len(out.requests)  # each request's adapter slot (-1: the base model)
        if self.lora is not None and any(r.lora_request is not None for r in out.requests):
            lora_slots = self.lora.activate([r.lora_request for r in out.requests])
        for i, (request, n) in enumerate(zip(out.requests, out.num_scheduled_tokens, strict=True)):
            drafts = out.spec_token_ids[i]
            start = out.num_computed_tokens[i]
            end = start + n - len(drafts)  # known tokens end here; proposals follow
            tokens = request.all_token_ids[start:end]
            if len(tokens) < end - start:  # the one pending token (async scheduling)
                fill_chunks.append(i)
                fill_rows.append(self._last_sampled_rows[request.request_id])
                tokens.append(0)
            chunks.append(SeqChunk(tokens + drafts, start, out.block_ids[i], lora_slots[i]))
            wants_prompt = request.prompt_logprobs is not None and start < request.num_prompt_tokens - 1
            if wants_prompt and not drafts:
                prompt_rows.append(i)
                if end == request.num_tokens + request.num_pending_tokens:
                    plain.append(i)  # its last row samples, as a plain row does
                num_logits.append(len(tokens))
            elif drafts:
                spec.append(i)
                num_logits.append(1 + len(drafts))
            elif end == request.num_tokens + request.num_pending_tokens:
                plain.append(i)
                num_logits.append(1)
            else:
                num_logits.append(0)  # a prefill chunk that does not reach the end of the prompt
        token_fill = None
        if fill_chunks:
            rows = torch.tensor(fill_rows, dtype=torch.long).to(self.device, non_blocking=True)
            token_fill = (fill_chunks, self._last_sampled_tokens[rows])
        logits = self.forward(chunks, num_logits, token_fill)

        step = LaunchedStep(len(out.requests), plain, spec)
        # Logit rows come chunk after chunk; split them between the two samplers. Not needed when
        # every row is a plain one (numpy costs tens of µs here, its memory cold after the forward).
        every_row_plain = len(plain) == logits.shape[0] and not prompt_rows and not spec
        offsets = None if every_row_plain else np.concatenate([[0], np.cumsum(num_logits)])
        if plain:
            requests = [out.requests[i] for i in plain]
            grammar = out.grammar_bitmask
            plain_logits = logits  # every logit row is a plain one, in order, unless others share the step
            if offsets is not None:
                last_rows = offsets[np.asarray(plain) + 1] - 1  # a plain chunk's one row is its last
                plain_logits = logits[torch.from_numpy(last_rows).to(self.device)]
            if grammar is None and all(plain_greedy(r) for r in requests):
                # What the sampler would do, without its set-up; a decode graph computed it already.
                compiled = getattr(self.model, "compiled", None)
                sampled = compiled.argmax_of(plain_logits) if compiled is not None else None
                if sampled is None:
                    sampled = argmax_rows(plain_logits)
            else:
                result = self.sampler(
                    plain_logits,
                    SamplingMetadata.from_requests(
                        requests,
                        self.spec.vocab_size,
                        self.device,
                        penalty_state=self.penalty_state,
                        pending_tokens=pending_tokens(plain, fill_chunks, token_fill),
                    ),
                    mask_logits=grammar.masker(plain) if grammar is not None else None,
                )
                step.plain_logprobs = result.logprobs
                sampled = result.sampled_token_ids
            if out.async_scheduled:  # the next step reads them from here
                self._last_sampled_tokens = sampled
                self._last_sampled_rows = {r.request_id: k for k, r in enumerate(requests)}
            if self.device.type == "cuda":  # copied while the host goes on; get() waits for it
                step.plain_tokens = sampled.to("cpu", non_blocking=True)
                step.ready = torch.cuda.Event()
                step.ready.record()
            else:
                step.plain_tokens = sampled
        for i in prompt_rows:
            step.prompt_logprobs[i] = self._prompt_logprobs(out, i, logits[offsets[i] : offsets[i + 1]])
        if spec:
            rows = torch.from_numpy(np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in spec]))
            verify_rows = [
                SpecDecodeRow(out.requests[i], out.spec_token_ids[i], out.spec_draft_probs[i]) for i in spec
            ]
            verify_mask = out.verify_bitmask
            verified = self.rejection_sampler(
                logits[rows.to(self.device)], verify_rows, self.spec.vocab_size, self.penalty_state,
                mask_logits=verify_mask.masker(list(range(len(rows)))) if verify_mask is not None else None,
            )  # fmt: skip
            step.spec_token_ids, step.spec_logprobs = verified.token_ids, verified.logprobs
        return step

    def _prompt_logprobs(
        self, out: SchedulerOutput, i: int, rows: torch.Tensor
    ) -> list[tuple[int, TokenLogprobs]]:
        """Logprobs of the prompt tokens chunk i's rows predict: row j (position start + j) predicts
        the token at start + j + 1, while that is a prompt token."""
        request = out.requests[i]
        start = out.num_computed_tokens[i]
        positions = range(start + 1, min(start + 1 + rows.shape[0], request.num_prompt_tokens))
        if not positions:
            return []
        targets = [request.prompt_token_ids[p] for p in positions]
        k = request.sampling_params.prompt_logprobs or 0
        return list(zip(positions, prompt_logprobs(rows[: len(targets)], targets, k), strict=True))

"""Which adapters are where: the device's slots (at most `max_loras`, LRU), host memory (up to
`max_cpu_loras` adapters, LRU) and, beyond that, their folders on disk.

- `load` reads and checks an adapter into host memory (off the engine thread: the server's executor
  or the offline caller), so a request never waits on the disk inside a step.
- `pin` / `unpin` bracket a request's life in the engine: a pinned adapter is never evicted from
  host memory (host memory may then hold more than max_cpu_loras, until the pins go).
- `activate` (the engine thread, before each forward with adapter rows) gives every adapter of the
  step a slot: the ones already there stay, the others take a free slot or the least recently used
  one no row of this step needs (the scheduler admits at most max_loras adapters at once, so one
  is always there). Eviction from a slot only drops the device copy: the host copy stays, and the
  next activation copies it back.
- An adapter's identity is its lora_int_id; its content digest (adapter.py) keys the prefix cache.
  Reloaded from disk after a host eviction, it must have the digest it was first loaded with.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from kvscale.worker.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from kvscale.worker.lora.request import LoRARequest
from kvscale.worker.lora.slots import LoRASlotTable

logger = logging.getLogger(__name__)


@dataclass
class _Known:
    request: LoRARequest
    allowed_roots: list[str] | None
    digest: str
    removed: bool = False


@dataclass
class LoRAStats:
    disk_loads: int = 0  # adapters read from their folders
    slot_loads: int = 0  # host -> device slot copies
    slot_evictions: int = 0  # a slot's adapter replaced by another
    host_evictions: int = 0  # adapters dropped from host memory (read from disk again when needed)


class LoRAManager:
    def __init__(
        self,
        spec,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec = spec
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.dtype = dtype
        self.table = LoRASlotTable(spec, max_loras, max_lora_rank, device, dtype)
        self.stats = LoRAStats()
        self._lock = threading.Lock()
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._known: dict[int, _Known] = {}
        self._pins: Counter[int] = Counter()
        self._slot_ids: list[int | None] = [None] * max_loras  # slot -> adapter id
        self._slot_used: list[int] = [0] * max_loras  # the activation that last used each slot
        self._activations = 0

    # -- host memory (any thread) ----------------------------------------------------------------
    def _check_identity(self, request: LoRARequest) -> None:
        known = self._known.get(request.lora_int_id)
        if known is not None and (known.request.lora_path, known.request.lora_name) != (
            request.lora_path,
            request.lora_name,
        ):
            raise AdapterError(
                f"lora_int_id {request.lora_int_id} is already adapter {known.request.lora_name!r} "
                f"({known.request.lora_path}); each adapter needs its own id"
            )

    def load(self, request: LoRARequest, allowed_roots: list[str] | None = None) -> LoRAAdapter:
        """The adapter in host memory, read from its folder unless there already. Raises
        AdapterError (a ValueError) for a folder it will not serve."""
        rid = request.lora_int_id
        with self._lock:
            self._check_identity(request)
            cached = self._host.get(rid)
            if cached is not None:
                self._host.move_to_end(rid)
                return cached
            known = self._known.get(rid)
            if known is not None:
                allowed_roots = known.allowed_roots
        adapter = self._read(request, allowed_roots)  # the disk, outside the lock
        with self._lock:
            self._check_identity(request)
            known = self._known.get(rid)
            if known is not None and known.digest != adapter.digest:
                raise AdapterError(
                    f"adapter {request.lora_name!r} changed on disk since it was loaded; load it again "
                    "under a new name"
                )
            if known is None or known.removed:
                self._known[rid] = _Known(request, allowed_roots, adapter.digest)
            self._host[rid] = adapter
            self._host.move_to_end(rid)
            self._evict_host()
        return adapter

    def _read(self, request: LoRARequest, allowed_roots: list[str] | None) -> LoRAAdapter:
        adapter = load_adapter(request, self.spec, self.max_lora_rank, self.dtype, allowed_roots)
        if self.device.type == "cuda":  # pinned: slot copies run asynchronously
            adapter.weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in adapter.weights.items()}
        self.stats.disk_loads += 1
        logger.info(
            "LoRA adapter %r loaded (rank %d, %s, %.1f MiB)",
            request.lora_name, adapter.rank, ",".join(sorted(adapter.target_modules)), adapter.nbytes / 2**20,
        )  # fmt: skip
        return adapter

    def _evict_host(self) -> None:
        """Drop least recently used adapters no request holds until max_cpu_loras remain (or only
        pinned ones do). Lock held."""
        over = len(self._host) - self.max_cpu_loras
        for rid in list(self._host):
            if over <= 0:
                break
            if self._pins[rid] == 0:
                del self._host[rid]
                self.stats.host_evictions += 1
                over -= 1
                known = self._known.get(rid)
                if known is not None and known.removed:
                    del self._known[rid]

    def pin(self, request: LoRARequest) -> None:
        """A request holding the adapter enters the engine (the engine thread). Reads it from disk
        again if it was evicted since `load` (rare: more adapters in flight than max_cpu_loras)."""
        with self._lock:
            self._check_identity(request)
            self._pins[request.lora_int_id] += 1
            present = request.lora_int_id in self._host
        if not present:
            try:
                self.load(request)
            except BaseException:
                self.unpin(request.lora_int_id)
                raise

    def unpin(self, lora_int_id: int) -> None:
        with self._lock:
            self._pins[lora_int_id] -= 1
            if self._pins[lora_int_id] <= 0:
                del self._pins[lora_int_id]
                known = self._known.get(lora_int_id)
                if known is not None and known.removed:
                    self._forget(lora_int_id)
                else:
                    self._evict_host()

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: at once if no request holds it, else when the last one finishes
        (they run to their end on it). Returns whether it was known."""
        with self._lock:
            known = self._known.get(lora_int_id)
            if known is None:
                return False
            known.removed = True
            if self._pins[lora_int_id] == 0:
                self._forget(lora_int_id)
            return True

    def _forget(self, lora_int_id: int) -> None:
        self._known.pop(lora_int_id, None)
        self._host.pop(lora_int_id, None)
        for slot, rid in enumerate(self._slot_ids):
            if rid == lora_int_id:
                self._slot_ids[slot] = None  # free; its stale weights are zeroed when it is reused

    def is_loaded(self, lora_int_id: int) -> bool:
        with self._lock:
            known = self._known.get(lora_int_id)
            return known is not None and not known.removed

    @property
    def num_host(self) -> int:
        return len(self._host)

    def resident(self) -> list[int]:
        """The adapter ids in device slots now."""
        return [rid for rid in self._slot_ids if rid is not None]

    def resident_names(self) -> list[str]:
        """The names of the adapters in device slots now that new requests may name (the metrics'
        kvscale_lora_adapter_resident, which the router's affinity reads). One being unloaded keeps
        its slot until its last request ends, but it takes no new request: not listed."""
        with self._lock:
            known = [self._known.get(rid) for rid in self._slot_ids if rid is not None]
            return sorted(k.request.lora_name for k in known if k is not None and not k.removed)

    # -- device slots (the engine thread) --------------------------------------------------------
    def activate(self, requests: list[LoRARequest | None]) -> list[int]:
        """Each request's slot for this step (-1: no adapter), loading the step's adapters into
        slots as needed. At most max_loras distinct adapters (the scheduler's guarantee)."""
        self._activations += 1
        wanted = {r.lora_int_id: r for r in requests if r is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters; at most max_loras={self.max_loras}")
        slot_of = {rid: s for s, rid in enumerate(self._slot_ids) if rid in wanted}
        for rid, request in wanted.items():
            if rid not in slot_of:
                slot = self._free_slot(set(slot_of.values()))
                adapter = self._host.get(rid)
                if adapter is None:  # evicted from host memory since it was pinned
                    adapter = self.load(request)
                if self._slot_ids[slot] is not None:
                    self.stats.slot_evictions += 1
                self.table.write(slot, adapter)
                self._slot_ids[slot] = rid
                self.stats.slot_loads += 1
                slot_of[rid] = slot
        for slot in slot_of.values():
            self._slot_used[slot] = self._activations
        return [-1 if r is None else slot_of[r.lora_int_id] for r in requests]

    def _free_slot(self, taken: set[int]) -> int:
        free = [s for s, rid in enumerate(self._slot_ids) if rid is None and s not in taken]
        if free:
            return free[0]
        candidates = [s for s in range(self.max_loras) if s not in taken]
        return min(candidates, key=lambda s: self._slot_used[s])  # least recently used

"""The compiled CPU forward as AOTInductor packages: built once per model, loaded by every worker.

`kvscale-worker compile` exports the model's per-token work (`LlamaForCausalLM.forward_tokens`)
with `torch.export` and compiles it ahead of time with AOTInductor into four packages (`.pt2`),
one per graph (see compilation.py):

- `decode1`: a decode step of one sequence, attention and the LM head inside the graph (static
  batch: its products are reductions, layers/linear.py);
- `decode_small`: the same for 2 to SMALL_ROWS[1] (8) sequences (its products are `W @ x.T`);
- `decoden`: the same for more sequences (dynamic batch, context and pool size);
- `chunk`: everything else (prefill chunks, speculative verification, spread-out decodes), 2+
  tokens, attention as the opaque `kvscale::unified_attention` op;
- `decode_lora` and `chunk_lora`, in the packages of workers with `--enable-lora` alone (their key
  says `lora`): `decoden` (from one sequence, the library's products) and `chunk` again for steps
  whose rows mix LoRA adapters and the base model, the adapters' products packed
  (kernels/lora.add_lora_packed) from the window of slot tables the step uses, passed in as inputs,
  so that neither max_loras nor the rank is built in.

The packages hold code, not weights (`package_constants_in_so=False`): a worker hands its own
parameters to the loaded runners (`user_managed`, no copy), so one package serves every checkpoint
of a shape, and a random-weight build (the compile command never reads the safetensors) serves the
real model. The rotary tables and KV caches are inputs, so neither max_model_len nor the pool size
is baked in.

A package is found by its key (`artefact_key`): the model's shape (DecoderSpec), dtype, KV block
size, torch's version and the CPU's ATen capability. Its folder is `<key digest>-<flags digest>`:
the instruction-set flags the compiler was told to use name it too, so a compile cache shared by
the replicas of a mixed fleet (a PVC, docs/operator.md) holds one package per CPU flavour side by
side, and a worker never replaces a package another CPU built. Loading checks what the key file
records against this machine: the same torch, the same capability, and every flag present in
/proc/cpuinfo. A package for another CPU is skipped (logged), never loaded, and the worker compiles
its own beside it. The code is built for the vector ISA inductor picks
(its -m flags) rather than `-march=native`, so that a package built on one machine of a CPU
generation runs on another; the OpenMP thread count is read at run time (`cpp.dynamic_threads`),
so a package built on a 16-core image builder serves a 2-CPU pod.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvscale.worker.model.aoti_runner import AOTIError, ReleasedGILRunner
from kvscale.worker.model.layers.linear import SMALL_ROWS, pack_weights, packs

logger = logging.getLogger(__name__)

# Bumped whenever what a package holds, or how it is called, changes: older packages are not found.
# 2: the decode graphs return logits (the LM head inside); 3: decode_small; 4: 16-bit weights keep
# the library's product in decode_small (layers/linear.py); 5: the decode graphs write the step's
# keys and values into the cache themselves (a slot-mapping input; logits the only output); 6: the
# CPU's weights are oneDNN-packed constants (layers/linear.py pack_weights); 7: the decode graphs
# return each row's argmax after the logits (the greedy token, reduced where the logits are hot)
FORMAT_VERSION = 7
GRAPHS = ("decode1", "decode_small", "decoden", "chunk")
LORA_GRAPHS = ("decode_lora", "chunk_lora")
# Run through the C ABI with the GIL released (aoti_runner.py): the graphs that call no Python.
# The chunk graphs call the attention op through torch's proxy executor and keep torch's runner.
GIL_FREE_GRAPHS = ("decode1", "decode_small", "decoden")
KEY_FILE = "key.json"
COMPILE_CACHE_ENV = "KVSCALE_COMPILE_CACHE"
# Packages that come with the installation (the worker image builds the default model's here).
SHIPPED_DIR = Path(sys.prefix) / "share" / "kvscale" / "compiled"

# gcc's -m flag -> /proc/cpuinfo's name, where they differ.
_CPUINFO_NAMES = {
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "avx512vbmi": "avx512vbmi",
    "amx-tile": "amx_tile",
    "amx-bf16": "amx_bf16",
    "amx-int8": "amx_int8",
    "f16c": "f16c",
}


def private_cache_dir() -> Path:
    """This user's own compile cache: ~/.cache/kvscale/compiled (in a pod, on its /tmp emptyDir)."""
    return Path.home() / ".cache" / "kvscale" / "compiled"


def default_cache_dir() -> Path:
    """Where built packages go: $KVSCALE_COMPILE_CACHE (in a pod, the compile-cache volume the
    replicas share), else the private one."""
    env = os.environ.get(COMPILE_CACHE_ENV)
    return Path(env) if env else private_cache_dir()


def unwritable(folder: Path) -> str | None:
    """Why a package cannot be built into folder (a read-only volume, another owner), or None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot be made ({e.strerror})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "is not writable"
    return None


def cpu_flags() -> frozenset[str]:
    """This machine's instruction-set flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def required_cpu_flags(arch_flags: str) -> list[str]:
    """The cpuinfo flags a compiler command line's `-mFOO` options need ("-mavx512f -mfma" ->
    avx512f, fma). `-mno-...` and `-march=...` are not features."""
    out = []
    for flag in arch_flags.split():
        if flag.startswith("-m") and not flag.startswith(("-mno-", "-march", "-mtune")):
            name = flag[2:]
            out.append(_CPUINFO_NAMES.get(name, name))
    return sorted(set(out))


def graphs_of(key: dict) -> tuple[str, ...]:
    return (*GRAPHS, *LORA_GRAPHS) if key.get("lora") else GRAPHS


def artefact_key(spec, dtype: torch.dtype, block_size: int, lora: bool = False) -> dict:
    """What a package is for: the model's shape, dtype, block size, torch and the CPU's capability,
    and whether it has the LoRA graphs (only then in the key: the base packages' digests stay).
    Its digest names the package's folder."""
    return ({"lora": True} if lora else {}) | {
        "format": FORMAT_VERSION,
        "model": dataclasses.asdict(spec),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "packed_weights": packs(dtype),  # the graphs take oneDNN-packed weights (layers/linear.py)
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def refusal(saved: dict, wanted: dict, host_flags: frozenset[str]) -> str | None:
    """Why a package whose key file says `saved` must not be loaded where `wanted` is this worker's
    key and host_flags this CPU's flags; None: it may. Pure."""
    fields = ("format", "torch", "cpu_capability", "dtype", "block_size", "model", "lora", "packed_weights")
    for field in fields:
        if saved.get(field) != wanted.get(field):
            return f"built for {field} {saved.get(field)!r}, this worker has {wanted.get(field)!r}"
    missing = sorted(set(saved.get("cpu_flags", [])) - host_flags)
    if missing:
        return f"built for CPU features this machine lacks: {', '.join(missing)}"
    return None


def flags_digest(cpu_flags: list[str]) -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags)).encode()).hexdigest()[:8]


def package_folder(cache_dir: Path, key: dict, cpu_flags: list[str]) -> Path:
    """Where the package of `key` compiled with `cpu_flags` goes: one folder per CPU flavour."""
    return cache_dir / f"{key_digest(key)}-{flags_digest(cpu_flags)}"


def _unusable(folder: Path, wanted: dict, host: frozenset[str]) -> str | None:
    """Why the package in folder cannot be loaded here (incomplete, unreadable, `refusal`), or None."""
    graphs = graphs_of(wanted)
    if not ((folder / KEY_FILE).is_file() and all((folder / f"{g}.pt2").is_file() for g in graphs)):
        return "incomplete"
    try:
        saved = json.loads((folder / KEY_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"its {KEY_FILE} cannot be read ({e})"
    return refusal(saved, wanted, host)


def find_package(key: dict, dirs: list[Path], host_flags: frozenset[str] | None = None) -> Path | None:
    """The first complete package for `key` among dirs that this machine may load (`refusal`: the
    key file's torch, capability and CPU flags); within a folder, the one built for the most CPU
    features first. Packages for other CPUs are skipped with a log line. Reads a few small files:
    no compiler runs. A build's scratch folder starts with a dot and is never matched."""
    digest = key_digest(key)
    wanted = json.loads(json.dumps(key))  # tuples as JSON has them
    host = cpu_flags() if host_flags is None else host_flags
    for d in dirs:
        found = []
        for folder in d.glob(f"{digest}-*"):
            reason = _unusable(folder, wanted, host)
            if reason is None:
                flags = json.loads((folder / KEY_FILE).read_text()).get("cpu_flags", [])
                found.append((-len(flags), folder.name, folder))
            elif reason != "incomplete":
                logger.info("skipping the compiled package %s: %s", folder, reason)
        if found:
            return min(found)[2]
    return None


# -- building -----------------------------------------------------------------------------------
def _wrappers(model) -> dict[str, torch.nn.Module]:
    decode = _Decode(model)
    chunk = _Chunk(model)
    return {
        "decode1": decode, "decode_small": decode, "decoden": decode, "chunk": chunk,
        "decode_lora": decode, "chunk_lora": chunk,
    }  # fmt: skip


class _Decode(torch.nn.Module):
    """forward_tokens with attention and the LM head in the graph, over flat inputs (AOTInductor
    takes tensors): after the KV caches, for decode_lora, LoRASlotTable.graph_inputs' tensors.
    Returns every row's logits and their argmax (the greedy token: reduced inside the graph, each
    thread over the logits it has just written, instead of by the host after the step, which reads
    them from the other core's cache). The step's keys and values are written into the caches
    (inputs mutated in place: AOTInductor writes into the caller's tensors, the pool is never
    copied) after every layer has read them, so attention sees the cache as it was before the step."""

    def __init__(self, model) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids, positions, cos, sin, block_tables, seq_lens, slot_mapping, *rest):
        from kvscale.kernels.kv_cache import write_kv_cache
        from kvscale.worker.model.llama import DecodeInputs

        kv, lora = rest[: 2 * self.m.spec.num_layers], rest[2 * self.m.spec.num_layers :]
        caches = [(kv[2 * i], kv[2 * i + 1]) for i in range(len(kv) // 2)]
        hidden, new_kv = self.m.forward_tokens(
            input_ids,
            positions,
            DecodeInputs(block_tables, seq_lens, caches),
            rope=(cos, sin),
            lora=_packed_lora(self.m, lora),
        )
        for (k_cache, v_cache), (k, v) in zip(caches, new_kv, strict=True):
            write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        logits = self.m.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)


def _packed_lora(model, inputs: tuple):
    """The LoRA graphs' trailing inputs as the layers apply them (None: a base-model graph)."""
    from kvscale.worker.lora.adapter import projection_shapes
    from kvscale.worker.lora.slots import PackedLoRA

    return PackedLoRA(list(inputs), projection_shapes(model.spec)) if inputs else None


class _Chunk(torch.nn.Module):
    """forward_tokens with attention as the opaque op (it reads the forward context at run time)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids, positions, cos, sin, *lora):
        return self.m.forward_tokens(input_ids, positions, rope=(cos, sin), lora=_packed_lora(self.m, lora))


def _example_inputs(model, dtype: torch.dtype, block_size: int, graph: str):
    """Inputs to trace each graph with, and their dynamic dimensions."""
    from torch.export import Dim

    spec = model.spec
    kv_heads = model.layout.num_kv_heads
    rot = model.rope_cos.shape[1] if model.rope_cos is not None else spec.head_dim // 2
    cos = torch.zeros(64, rot)
    sin = torch.zeros(64, rot)
    rope_dim = Dim("positions", min=2)
    if graph in ("chunk", "chunk_lora"):
        t = Dim("tokens", min=2)
        ids = torch.zeros(5, dtype=torch.long)
        dims = ({0: t}, {0: t}, {0: rope_dim}, {0: rope_dim})
        if graph == "chunk":
            return (ids, ids.clone(), cos, sin), dims
        lora, lora_dims = _example_lora_inputs(model, dtype, 5, t)
        return (ids, ids.clone(), cos, sin, *lora), (*dims, tuple(lora_dims))  # *lora: one
    batch = {"decode1": 1, "decoden": SMALL_ROWS[1] + 2}.get(graph, 3)
    blocks = Dim("blocks", min=2)
    pool = Dim("pool", min=2)
    kv = [
        torch.zeros(kv_heads, 4, block_size, spec.head_dim, dtype=dtype) for _ in range(2 * spec.num_layers)
    ]
    ids = torch.zeros(batch, dtype=torch.long)
    tables = torch.zeros(batch, 3, dtype=torch.long)
    lens = torch.ones(batch, dtype=torch.long)
    slot_mapping = torch.arange(batch, dtype=torch.long)
    # decode_lora takes a single sequence too (one stream on an adapter): batch from 1.
    b = {
        "decode1": None,
        "decode_small": Dim("batch", min=2, max=SMALL_ROWS[1]),
        "decoden": Dim("batch", min=SMALL_ROWS[1] + 1),
        "decode_lora": Dim("batch", min=1),
    }[graph]
    per_seq = {} if b is None else {0: b}
    dims = (per_seq, per_seq, {0: rope_dim}, {0: rope_dim}, {**per_seq, 1: blocks}, per_seq, per_seq)
    rest, rest_dims = kv, [{1: pool} for _ in kv]
    if graph == "decode_lora":
        lora, lora_dims = _example_lora_inputs(model, dtype, batch, b)
        rest, rest_dims = rest + lora, rest_dims + lora_dims
    inputs = (ids, ids.clone(), cos, sin, tables, lens, slot_mapping, *rest)
    return inputs, (*dims, tuple(rest_dims))  # *rest: one


def _example_lora_inputs(model, dtype: torch.dtype, num_tokens: int, tokens):
    """LoRASlotTable.graph_inputs' tensors for tracing: 3 slots of 5 rows each, rank 7, and their
    dynamic dimensions (the window's slots, rows per slot, the tables' rank; `tokens`: the step's)."""
    from torch.export import Dim

    from kvscale.worker.lora.adapter import projection_shapes

    slots, length, rank = Dim("lora_slots", min=1), Dim("lora_rows", min=1), 7
    gather, inverse = torch.zeros(3, 5, dtype=torch.long), torch.zeros(num_tokens, dtype=torch.long)
    flat, dims = [gather, inverse], [{0: slots, 1: length}, {0: tokens}]
    shapes = projection_shapes(model.spec)
    r = Dim("lora_rank", min=1)
    for _ in range(model.spec.num_layers):
        for s in shapes.values():
            n = len(s.slices)
            flat += (torch.zeros(3, n * rank, s.in_features, dtype=dtype),
                     torch.zeros(3, n * rank, s.out_features, dtype=dtype))  # fmt: skip
            stacked = n * r if n > 1 else r
            dims += ({0: slots, 1: stacked}, {0: slots, 1: stacked})
    return flat, dims


def cpu_arch_flags() -> str:
    """The -m flags inductor compiles CPU code with on this machine (its vector ISA)."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return "" if not isa else isa.build_arch_flags()


@contextlib.contextmanager
def _packed_constants():
    """Let inductor take oneDNN-packed weights as constants. Unlifting the exported graph clones
    every constant with its strides, which an opaque oneDNN tensor has none of; a weight is never
    written, so the packed one is used as it is. The package holds no constant (the worker hands
    its own over at load), only the call of the packed product (`aoti_torch_cpu__linear_pointwise`)."""
    from torch._inductor import compile_fx

    clone = compile_fx.clone_preserve_strides
    compile_fx.clone_preserve_strides = lambda t: t if t.is_mkldnn else clone(t)
    try:
        yield
    finally:
        compile_fx.clone_preserve_strides = clone


def build_package(
    model,
    dtype: torch.dtype,
    block_size: int,
    cache_dir: Path,
    progress=print,
    replace: bool = False,
    lora: bool = False,
) -> Path:
    """Export and compile the graphs of `model` (weights need not be loaded; `lora`: decode_lora too) into
    cache_dir/<digest>-<flags>, written aside and renamed into place: workers sharing the folder (a
    PVC) never see half a package, and of two building at once the first rename wins and the second
    drops its copy (the same package). A package already there for this CPU is replaced only when it
    cannot be loaded, or with `replace`. Returns the folder."""
    import torch._inductor.config as inductor_config

    key = artefact_key(model.spec, dtype, block_size, lora)
    graphs = graphs_of(key)
    arch = cpu_arch_flags()
    # The vector ISA's flags alone, not -march=native: the code must run on every CPU that has them.
    inductor_config.cpp.march = ""
    inductor_config.cpp.dynamic_threads = True  # the OpenMP thread count is read at run time
    key["cpu_flags"] = required_cpu_flags(arch)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = package_folder(cache_dir, artefact_key(model.spec, dtype, block_size, lora), key["cpu_flags"])
    # Beside the final folder, on the same filesystem, so the rename is atomic (a shared volume).
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
    scratch.chmod(0o755)  # mkdtemp's 0700 would hide it from replicas running as another user
    try:
        wrappers = _wrappers(model)
        for i, graph in enumerate(graphs):
            started = time.monotonic()
            args, dynamic = _example_inputs(model, dtype, block_size, graph)
            with torch.inference_mode():
                exported = torch.export.export(wrappers[graph], args, dynamic_shapes=dynamic)
            step = f"compiling graph {i + 1}/{len(graphs)} ({graph})"
            progress(f"{step}: exported in {time.monotonic() - started:.1f} s")
            with _packed_constants():
                torch._inductor.aoti_compile_and_package(
                    exported,
                    package_path=str(scratch / f"{graph}.pt2"),
                    inductor_configs={"aot_inductor.package_constants_in_so": False},
                )
            progress(f"{step}: done in {time.monotonic() - started:.1f} s")
        (scratch / KEY_FILE).write_text(json.dumps(key, indent=1, sort_keys=True))
        wanted = json.loads(json.dumps(artefact_key(model.spec, dtype, block_size, lora)))
        if final.exists() and (replace or _unusable(final, wanted, cpu_flags()) is not None):
            # Ours, for this CPU, yet not loadable (a torn copy) or a forced rebuild: set aside, replaced.
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            with contextlib.suppress(OSError):  # another builder set it aside first
                final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            scratch.rename(final)
        except OSError:  # another builder finished first (two pods at once): theirs is the same
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return final


# -- loading ------------------------------------------------------------------------------------
class PackageRefused(Exception):
    """A package that must not be loaded here (built for other CPU features or another torch)."""


def load_package(folder: Path, model, dtype: torch.dtype, block_size: int, lora: bool = False):
    """The runners of a package, with this model's parameters as their constants (no copy).
    Raises PackageRefused when its key file does not fit this worker and machine."""
    from torch.export.pt2_archive._package import AOTICompiledModel

    saved = json.loads((folder / KEY_FILE).read_text())
    # tuples as JSON has them
    wanted = json.loads(json.dumps(artefact_key(model.spec, dtype, block_size, lora)))
    reason = refusal(saved, wanted, cpu_flags())
    if reason is not None:
        raise PackageRefused(f"{folder}: {reason}")
    runners = {}
    wrappers = _wrappers(model)
    for graph in graphs_of(wanted):
        named = dict(wrappers[graph].named_parameters(remove_duplicate=False))
        named.update(wrappers[graph].named_buffers(remove_duplicate=False))
        if graph in GIL_FREE_GRAPHS:
            try:
                runners[graph] = ReleasedGILRunner(folder / f"{graph}.pt2", named)
            except AOTIError as e:
                raise PackageRefused(str(e)) from e
            continue
        # The loader itself (torch._inductor.aoti_load_package also probes the vector ISA by
        # compiling test programs, seconds of g++ for a warning; refusal() has checked the CPU).
        loader = torch._C._aoti.AOTIModelPackageLoader(
            str(folder / f"{graph}.pt2"), "model", False, 1, -1, False
        )
        runner = AOTICompiledModel(loader)
        constants = runner.get_constant_fqns()
        unknown = [name for name in constants if name not in named]
        if unknown:
            raise PackageRefused(f"{folder}: {graph} wants constants this model lacks: {unknown[:4]}")
        runner.load_constants({n: named[n] for n in constants}, check_full_update=True, user_managed=True)
        runners[graph] = loader
    return runners


def build_for_model(
    model_path: str,
    dtype_name: str,
    block_size: int,
    cache_dir: Path,
    force: bool = False,
    progress=print,
    lora: bool = False,
) -> tuple[Path, bool]:
    """The package for a model folder (its config alone: no weight is read), built unless one for
    this machine is already in cache_dir. Returns (folder, whether it was built now)."""
    from kvscale.worker.model.llama import LlamaForCausalLM
    from kvscale.worker.model.loader import allocate_parameters, load_config, resolve_dtype

    config = load_config(model_path)
    cpu = torch.device("cpu")
    dtype = resolve_dtype(dtype_name, config, cpu)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position=64)
    model.tie_weights()
    allocate_parameters(model, cpu, dtype)  # never written: the package holds code, not weights
    pack_weights(model)  # as load_model does: the graphs take the packed weights
    model.init_rope(cpu)
    key = artefact_key(model.spec, dtype, block_size, lora)
    with build_lock(cache_dir, progress):
        found = find_package(key, [cache_dir])
        if found is not None and not force:
            try:
                load_package(found, model, dtype, block_size, lora)
                return found, False
            except Exception as e:  # a torn or foreign package under this CPU's name: replaced
                progress(f"cannot load {found} ({e}); compiling anew")
                force = True
        what = " with the LoRA graphs" if lora else ""
        progress(
            f"compiling the forward of {model_path}{what} ({dtype}, block size {block_size}) into {cache_dir}"
        )
        return build_package(model, dtype, block_size, cache_dir, progress, replace=force, lora=lora), True


def shadows_stdlib(entry: str, stdlib_dirs: frozenset[str]) -> bool:
    """Whether sys.path entry `entry` ('' is the working directory) holds a package named as a
    standard-library module, outside the standard library's own folders."""
    folder = os.path.realpath(entry or os.getcwd())
    if folder in stdlib_dirs:
        return False
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(
        n in sys.stdlib_module_names and os.path.isfile(os.path.join(folder, n, "__init__.py")) for n in names
    )


def probe_pythonpath() -> str:
    """The PYTHONPATH for inductor's child processes: torch's folder and this process' sys.path, as
    inductor builds it, less the entries that shadow the standard library. From this repository's
    root (the tests, the benchmarks, a fresh clone's `generate`) its `operator/` folder took the
    place of the standard `operator` module in the child that checks the CPU's vector ISA, which
    then failed: the package was built without vector code (2x slower a step, measured)."""
    import sysconfig

    folders = (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"), os.path.dirname(os.__file__))
    stdlib = frozenset(os.path.realpath(p) for p in folders if p)
    torch_root = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    return os.pathsep.join(p for p in (torch_root, *sys.path) if not shadows_stdlib(p, stdlib))


@contextlib.contextmanager
def private_inductor_cache():
    """Inductor's intermediate files (generated C++, kernels, their metadata) for this build alone,
    in a folder inside the one inductor would use (checked writable and exec), removed after:
    other builds on the machine write the same paths for the same kernels, and a package once took
    another build's half-written file (see build_lock). The package is the cache that matters."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TORCH_CUSTOM_PYTHONPATH")}
    base = saved["TORCHINDUCTOR_CACHE_DIR"] or default_cache_dir()
    os.makedirs(base, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="kvscale-build-", dir=base)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch  # read by inductor at each use
    os.environ.setdefault("TORCH_CUSTOM_PYTHONPATH", probe_pythonpath())
    try:
        yield scratch
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(scratch, ignore_errors=True)


BUILD_LOCK = ".build.lock"


@contextlib.contextmanager
def build_lock(cache_dir: Path, progress=print):
    """One build at a time in a cache folder (an flock, which the kernel drops if its holder dies):
    workers starting together on one machine build once and the others load that package, rather
    than compile the same graphs side by side. Side by side they cost each other the CPU, and
    inductor's shared intermediate files raced: one package got another build's half-written
    (empty) kernel_metadata.json and could never load (measured: three bench workers)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / BUILD_LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"another build holds {cache_dir / BUILD_LOCK}; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

"""Load a Hugging Face model folder: config and tokenizer through transformers, weights straight
from its safetensors files into our decoder (no transformers model is ever built)."""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer

from kvscale.worker.model.layers.linear import pack_weights
from kvscale.worker.model.llama import LlamaForCausalLM
from kvscale.worker.model.mapped_reader import LoadProgress, read_mapped
from kvscale.worker.sample.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """'auto': the checkpoint's dtype on CUDA; float32 on CPU, where half-precision matmuls are slow."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = DTYPES.get(saved)
    return torch.bfloat16 if saved in (None, torch.float32) else saved


def load_config(model_path: str):
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(f"{model_path!r} is not a model folder: it has no config.json")
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def load_generation_defaults(model_path: str) -> dict[str, float]:
    """The sampling defaults the model's generation_config.json sets, as vLLM's
    `--generation-config auto` reads them: only the keys the file names (transformers' own
    defaults, such as its top_k of 50, are not the model's), `do_sample` ignored. Validated here,
    so that a bad file refuses the model rather than every request."""
    path = Path(model_path, "generation_config.json")
    if not path.is_file():
        return {}
    saved = json.loads(path.read_text())
    defaults = {name: saved[name] for name in GENERATION_CONFIG_FIELDS if saved.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: unusable sampling default: {e}") from None
    return defaults


def _safetensors_files(model_path: str) -> list[Path]:
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_path!r}")
    return files


def load_model(
    model_path: str, hf_config, max_position: int, device: torch.device, dtype: torch.dtype, tp=None
):
    """Build the decoder on the meta device, allocate its parameters at the serving dtype, then fill
    them from the checkpoint. Each file is memory-mapped and its tensors are copied, several threads
    at a time, straight from the map into their parameters, cast on the way (mapped_reader.py): no
    staging buffer, and neither the device nor the host ever holds a wider dtype than it serves (a
    float32 checkpoint served in bfloat16 is never materialised in float32). Under tensor
    parallelism (tp) a rank reads only its own slice of each tensor (iter_safetensors_shards)."""
    started = time.monotonic()
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config, max_position, tp)
    model.tie_weights()
    allocate_parameters(model, device, dtype)
    params = dict(model.named_parameters())
    files = _safetensors_files(model_path)
    progress = LoadProgress(f"loading weights ({len(files)} file{'s' * (len(files) > 1)})")
    if tp is None:
        headers = [read_safetensors_header(path) for path in files]
        targets = read_mapped(
            files,
            headers,
            SAFETENSORS_DTYPES,
            lambda name, t: _load_one(model, params, name, t),
            progress=progress,
        )
    else:
        targets, done, total = [], 0, sum(p.stat().st_size for p in files)
        for _, name, tensor in iter_safetensors_shards(files, model):
            targets.append(_load_one(model, params, name, tensor))
            done += tensor.numel() * tensor.element_size()
            progress(done, total)
    loaded = {t for t in targets if t}

    missing = sorted(_expected_keys(model) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_path!r} lacks weights for: {', '.join(missing[:8])}")
    if tp is None:
        del params  # its references would keep every plain weight alive beside its packed copy
        pack_weights(model)  # the CPU's blocked layout (layers/linear.py); a no-op elsewhere
    model.init_rope(device)
    model.eval()
    seconds = time.monotonic() - started
    size = sum(p.stat().st_size for p in files)
    logger.info(
        "model loaded in %.1fs (%s, %s; %.2f GB at %.2f GB/s)",
        seconds,
        device,
        dtype,
        size / 1e9,
        size / 1e9 / seconds,
    )
    return model


MADV_HUGEPAGE = 14
HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask for transparent huge pages under a large host tensor (where THP is `madvise`, the usual
    default): the loader's first write into it then takes one page fault per 2 MiB, not per 4 KiB."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < 2 * HUGE_PAGE or sys.platform != "linux":
        return
    start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def allocate_parameters(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace every meta parameter by an uninitialised one of the serving dtype on the device
    (`to_empty` would allocate the default dtype first, and untie tied weights)."""
    allocated: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in allocated:
                empty = torch.empty(param.shape, dtype=dtype, device=device)
                if device.type == "cpu":
                    advise_huge_pages(empty)
                allocated[id(param)] = torch.nn.Parameter(empty, requires_grad=False)
            setattr(module, name, allocated[id(param)])


# https://huggingface.co/docs/safetensors/index#format: an 8-byte little-endian header length, a
# JSON header (name -> dtype, shape, [begin, end) byte offsets after the header), the raw data.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, name -> {dtype, shape, data_offsets}) of a .safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
    return 8 + header_len, header


def iter_safetensors(files: list[Path]):  # the reader before mapped_reader.py: bench load compares
    """(file index, name, CPU tensor) for every tensor of the files, in file order. Plain reads into
    one staging buffer sized for the largest tensor: unlike a memory map, the files' pages never
    count as this process' memory, and one buffer reused throughout leaves nothing behind. Each
    tensor is a view of that buffer, valid until the next one is read: copy it out first."""
    headers = [read_safetensors_header(path) for path in files]
    largest = max(
        (end - begin for _, h in headers for begin, end in (i["data_offsets"] for i in h.values())), default=0
    )
    staging = torch.empty(largest, dtype=torch.uint8)
    for n, (path, (data_start, header)) in enumerate(zip(files, headers, strict=True)):
        with open(path, "rb") as f:
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = info["data_offsets"]
                raw = staging[: end - begin]
                f.seek(data_start + begin)
                if end > begin and f.readinto(raw.numpy()) != end - begin:
                    raise ValueError(f"{path.name}: tensor {name!r} is truncated")
                yield n, name, raw.view(SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])


def iter_safetensors_shards(files: list[Path], model: LlamaForCausalLM):
    """(file index, name, CPU tensor) like iter_safetensors, each tensor cut to this rank's slice
    (tp_slice) as it is read: safetensors' get_slice reads those bytes only."""
    from safetensors import safe_open

    for n, path in enumerate(files):
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                part = f.get_slice(name)
                cut = tp_slice(model, name)
                if cut is None:
                    yield n, name, part[:]
                else:
                    dim, start, stop = cut
                    yield n, name, part[start:stop] if dim == 0 else part[:, start:stop]


def tp_slice(model: LlamaForCausalLM, name: str) -> tuple[int, int, int] | None:
    """(dim, start, stop) of checkpoint tensor `name` that this rank holds; None: all of it (norms,
    and the biases of row-parallel layers, added once after their all-reduce)."""
    layout, spec = model.layout, model.spec
    hd = spec.head_dim
    q, kv, inter = layout.num_heads * hd, layout.num_kv_heads * hd, layout.intermediate_size
    if ".q_proj." in name:
        return 0, layout.rank * q, (layout.rank + 1) * q
    if ".k_proj." in name or ".v_proj." in name:
        return 0, layout.kv_head_start * hd, layout.kv_head_start * hd + kv
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, layout.rank * inter, (layout.rank + 1) * inter
    if name.endswith("o_proj.weight"):
        return 1, layout.rank * q, (layout.rank + 1) * q
    if name.endswith("down_proj.weight"):
        return 1, layout.rank * inter, (layout.rank + 1) * inter
    if name in VOCAB_PARALLEL:
        start = layout.vocab_start
        return 0, start, min(start + layout.vocab_per_rank, spec.vocab_size)
    return None


VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
FUSED_SHARDS = {"qkv_proj": 3, "gate_up_proj": 2}


def _expected_keys(model: LlamaForCausalLM) -> set[str]:
    """One key per plain parameter, one per shard of a fused one (see _load_one)."""
    keys = set()
    for name, _ in model.named_parameters():
        fused = next((f for f in FUSED_SHARDS if f".{f}." in name), None)
        keys.update([f"{name}#{i}" for i in range(FUSED_SHARDS[fused])] if fused else [name])
    if model.spec.tie_word_embeddings:
        keys.discard("lm_head.weight")
    return keys


def _load_one(model: LlamaForCausalLM, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one checkpoint tensor into its (possibly fused) parameter; returns the key it filled."""
    if "rotary_emb.inv_freq" in name:
        return None  # a buffer some old checkpoints carry; we compute our own tables
    if name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None
    for shard_name, (fused, shard) in model.stacked_params.items():
        part = f".{shard_name}."
        if part in name:
            target = name.replace(part, f".{fused}.")
            offset, size = _shard_range(model, fused, shard)
            _copy(params[target].data[offset : offset + size], tensor, name)
            return f"{target}#{shard}"
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in the checkpoint")
    dst = params[name].data
    if name in VOCAB_PARALLEL and model.tp is not None:  # the last rank's rows past the vocabulary
        dst[tensor.shape[0] :].zero_()
        dst = dst[: tensor.shape[0]]
    _copy(dst, tensor, name)
    return name


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if dst.device.type == "cpu" and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
        # A plain memcpy that releases the GIL and starts no OpenMP team: the loader's threads copy
        # side by side (torch's copy_ in each would wake its own pool of threads on the same cores).
        raw = (
            torch.uint8
            if dst.element_size() == 1
            else torch.int16
            if dst.element_size() == 2
            else torch.int32
        )
        if dst.element_size() in (1, 2, 4) and dst.numel():
            np.copyto(dst.view(raw).numpy(), src.view(raw).numpy())
            return
    if dst.device != src.device:
        src = src.to(dst.dtype)  # cast on the host: the device never sees a wider dtype
    dst.copy_(src)  # on the host, copy_ casts in place


def _shard_range(model: LlamaForCausalLM, fused: str, shard: int) -> tuple[int, int]:
    """(offset, size) of a checkpoint shard in this rank's fused parameter."""
    layout = model.layout
    if fused == "qkv_proj":
        q, kv = layout.num_heads * model.spec.head_dim, layout.num_kv_heads * model.spec.head_dim
        return [(0, q), (q, kv), (q + kv, kv)][shard]
    return shard * layout.intermediate_size, layout.intermediate_size

"""Loading a checkpoint: the worker's loader in GB/s against `cat FILES > /dev/null` of the same files,
with a cold and a warm page cache (issue 29).

    python -m kvscale.worker.bench load --json          # as root: cold runs drop the page cache

The checkpoint is made locally, once, in --checkpoint (default /tmp/kvscale-1b-bf16): a
Llama-3.2-1B-shaped model (1.24B parameters, tied embeddings) with random bf16 weights in
--shards safetensors files; nothing is downloaded. Each run loads it into a new model at bf16 on
the CPU (`loader.load_model`: memory maps, --threads copying threads) and, for comparison, with the
reader before it (`staged`: plain reads into one staging buffer, then a copy) and `cat`. Cold: the
page cache is dropped first (`echo 3 > /proc/sys/vm/drop_caches`, root only; skipped otherwise).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

# Llama 3.2 1B's shape.
SHAPE = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
)  # fmt: skip


def add_parser(sub, parents) -> None:
    p = sub.add_parser("load", parents=parents, help="the checkpoint loader's GB/s against cat (cold, warm)")
    p.add_argument("--checkpoint", default="/tmp/kvscale-1b-bf16", help="made there if missing")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", default="8,1", help="copying threads of the mapped loader (comma-separated)")
    p.add_argument("--modes", default="cat,mapped,staged")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a smaller checkpoint; tests)")
    p.add_argument("--vocab-size", type=int, default=None)
    p.set_defaults(func=run)


def make_checkpoint(path: Path, shards: int, overrides: dict) -> None:
    """Random bf16 weights of the shape, split by layers over `shards` files with an index."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    shape = {**SHAPE, **overrides}
    scratch = path.with_name(path.name + ".tmp")
    scratch.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape, rms_norm_eps=1e-5, max_position_embeddings=4096).save_pretrained(scratch)
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    layers = shape["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map: dict[str, str] = {}
    per_shard = -(-layers // shards)
    for s in range(shards):
        tensors = {}
        if s == 0:
            tensors["model.embed_tokens.weight"] = rand(shape["vocab_size"], h)
        for i in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            pre = f"model.layers.{i}."
            tensors |= {
                pre + "self_attn.q_proj.weight": rand(q, h), pre + "self_attn.k_proj.weight": rand(kv, h),
                pre + "self_attn.v_proj.weight": rand(kv, h), pre + "self_attn.o_proj.weight": rand(h, q),
                pre + "mlp.gate_proj.weight": rand(inter, h), pre + "mlp.up_proj.weight": rand(inter, h),
                pre + "mlp.down_proj.weight": rand(h, inter),
                pre + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                pre + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }  # fmt: skip
        if s == shards - 1:
            tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, scratch / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
    (scratch / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    scratch.rename(path)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def load_staged(path: str, config) -> None:
    """The loader before the memory maps: plain reads into a staging buffer, one tensor at a time."""
    import torch

    from kvscale.worker.model import loader
    from kvscale.worker.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config, 4096)
    model.tie_weights()
    loader.allocate_parameters(model, torch.device("cpu"), torch.bfloat16)
    params = dict(model.named_parameters())
    for _, name, tensor in loader.iter_safetensors(loader._safetensors_files(path)):
        loader._load_one(model, params, name, tensor)


def run(args) -> dict[str, Any]:
    import torch

    from kvscale.worker.model import loader, mapped_reader

    path = Path(args.checkpoint)
    overrides = {k: v for k, v in (("num_hidden_layers", args.layers), ("vocab_size", args.vocab_size)) if v}
    if not path.is_dir():
        make_checkpoint(path, args.shards, overrides)
    files = loader._safetensors_files(str(path))
    size = sum(f.stat().st_size for f in files)
    config = loader.load_config(str(path))

    def mapped(threads: int):
        def go():
            mapped_reader.LOAD_THREADS = threads
            loader.load_model(str(path), config, 4096, torch.device("cpu"), torch.bfloat16)

        return go

    runners = {
        "cat": lambda: subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    }
    for t in (int(x) for x in args.threads.split(",") if x):
        runners[f"mapped_t{t}"] = mapped(t)
    runners["staged"] = lambda: load_staged(str(path), config)
    modes = [m for m in runners if m.split("_")[0] in args.modes.split(",")]
    result: dict[str, Any] = {
        "checkpoint": str(path), "bytes": size, "files": len(files), "runs": args.runs,
        "cpus": len(os.sched_getaffinity(0)), "cold_dropped": None, "gb_per_s": {},
    }  # fmt: skip
    for cache in args.caches.split(","):
        for mode in modes:
            rates = []
            for _ in range(args.runs):
                if cache == "cold":
                    result["cold_dropped"] = drop_page_cache()
                else:
                    runners["cat"]()  # every page in the cache
                gc.collect()
                started = time.perf_counter()
                runners[mode]()
                rates.append(size / 1e9 / (time.perf_counter() - started))
                gc.collect()
            result["gb_per_s"][f"{mode}_{cache}"] = {
                "median": round(statistics.median(rates), 3), "runs": [round(r, 3) for r in rates]
            }  # fmt: skip
    return result

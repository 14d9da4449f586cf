"""Benchmark workloads: prompts cut from held-out Python code, long-tailed lengths, all seeded.

The held-out split of the fixture models is every stdlib module whose name starts with p, q or r
(see ../shared/models/README.md); those files ship with every Python, so any machine rebuilds the
same prompts without a download.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids, BOS first
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def held_out_sources(code_only: bool = False) -> list[Path]:
    """code_only leaves out pydoc_data/topics.py, which is mostly English text in string literals
    (the models' README calls the rest "held-out code")."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in stdlib.glob("[pqr]*.py")] + [p for p in stdlib.glob("[pqr]*/*.py")]
    if code_only:
        files = [p for p in files if p.parts[-2:] != ("pydoc_data", "topics.py")]
    return sorted(p for p in files if "site-packages" not in p.parts and p.stat().st_size > 2000)


def long_tailed(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """Log-normal, clipped: most values near the median, a few up to `hi`."""
    return max(lo, min(hi, round(rng.lognormvariate(0.0, sigma) * median)))


def code_workload(
    tokenizer,
    num_requests: int,
    seed: int = 0,
    prompt_len: tuple[float, int, int] = (96, 16, 1024),  # median, min, max
    output_len: tuple[float, int, int] = (64, 16, 512),
    sigma: float = 1.0,
    code_only: bool = False,
) -> Workload:
    rng = random.Random(seed)
    corpus = [
        tokenizer.encode(p.read_text(errors="replace"), add_special_tokens=False)
        for p in held_out_sources(code_only)
    ]
    corpus = [ids for ids in corpus if len(ids) > prompt_len[2] + 1]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = long_tailed(rng, prompt_len[0], sigma, prompt_len[1], prompt_len[2])
        source = rng.choice(corpus)
        start = rng.randrange(0, len(source) - n)
        prompts.append(bos + source[start : start + n - len(bos)])
        outputs.append(long_tailed(rng, output_len[0], sigma, output_len[1], output_len[2]))
    return Workload(prompts, outputs)

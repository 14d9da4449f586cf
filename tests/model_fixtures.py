"""Model paths and random configs shared by the tests and conftest fixtures."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A checkout's ../shared, unless KVSCALE_SHARED_MODELS names another (a git worktree elsewhere).
SHARED_MODELS = Path(os.environ.get("KVSCALE_SHARED_MODELS") or REPO.parent / "shared" / "models")
TARGET = SHARED_MODELS / "tiny-code-target"
DRAFT = SHARED_MODELS / "tiny-code-draft"

# Small random configs covering each family: GQA and MHA, tied and untied embeddings, biases,
# per-head q/k norms, rope scaling variants.
RANDOM_CONFIGS = {
    "llama-gqa": dict(architecture="llama", num_heads=4, num_kv_heads=2),
    "llama-mha-untied": dict(architecture="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=False),
    "llama3-rope": dict(
        architecture="llama",
        num_heads=4,
        num_kv_heads=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "mistral": dict(architecture="mistral", num_heads=4, num_kv_heads=2, sliding_window=None),
    "mistral-sliding": dict(architecture="mistral", num_heads=4, num_kv_heads=2, sliding_window=24),
    "qwen2": dict(architecture="qwen2", num_heads=4, num_kv_heads=2),
    "qwen2-yarn": dict(
        architecture="qwen2",
        num_heads=4,
        num_kv_heads=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    ),
    "qwen3": dict(architecture="qwen3", num_heads=4, num_kv_heads=2, head_dim=32),
}

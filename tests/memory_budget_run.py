"""One GRPO update under ``micro_batch_tokens: auto`` with a memory limit, in a process of its own, on a
model with Qwen2.5's vocabulary (151,936) and a small body: prints the decision and the process's peak
RSS as JSON. Run by ``tests/test_memory_budget_rss.py``:

    python tests/memory_budget_run.py SEQUENCES TOKENS LIMIT_GIB
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.trainer_memory import SHAPES, VOCABULARY, Row, trajectories
from trainer.memory_budget import GiB, RssMeter


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.config import GRPOConfig
    from trainer.distributed import make_accelerator
    from trainer.policy import Policy

    sequences, tokens, limit = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCABULARY, max_position_embeddings=32768, **SHAPES["cpu-small"]))
    config = GRPOConfig(progress=False, memory_limit_gib=limit, packing=False)  # the defaults: auto, null
    policy = Policy(config, make_accelerator(), lm, pad_id=0)
    metrics = policy.update(trajectories(Row("cpu-small", sequences, tokens, 0, "chunked")))
    budget = policy.budget
    assert budget is not None
    print(json.dumps({
        "tokens": budget.tokens, "checkpointing": budget.checkpointing, "fits": budget.fits,
        "expected_peak_gib": budget.expected_peak / GiB, "probe_s": budget.probe_s,
        "update_peak_gib": metrics["peak_memory_gib"], "process_peak_gib": RssMeter().peak() / GiB,
    }))  # fmt: skip


if __name__ == "__main__":
    main()

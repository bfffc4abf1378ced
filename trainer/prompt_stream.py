"""The prompts of a GRPO run (``GRPOConfig``): its data file or a synthetic task, in a fixed seeded order."""

from __future__ import annotations

import math
import random

from data.schema import Record, load_records
from data.synthetic import make_task
from trainer.config import GRPOConfig


class PromptStream:
    """Prompts in a fixed, seeded order; ``take(n)`` continues where the last call stopped."""

    def __init__(self, config: GRPOConfig):
        if config.data:
            self.records = load_records(config.data)[: config.num_prompts]
            random.Random(config.seed).shuffle(self.records)
        else:
            per_step = math.ceil(config.prompts_per_step * (config.oversample if config.filter_groups else 1))
            self.records = make_task(config.task or "calc", config.num_prompts or per_step * config.steps, config.seed)
        self.position = 0
        self.sources = sorted({record.data_source for record in self.records})
        """The stream's data sources: the same on every process, so per-source metrics sum across them."""

    def take(self, count: int) -> list[Record]:
        taken = [self.records[(self.position + i) % len(self.records)] for i in range(count)]
        self.position += count
        return taken

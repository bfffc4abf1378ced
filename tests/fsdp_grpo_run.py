"""GRPO steps run by tests/test_grpo_fsdp.py under `accelerate launch` (one plain process, or two
processes with Accelerate's FSDP2 plugin), writing what the test compares: the gradient of the
first update (gathered from the shards), the full weights when training ends, those just after a
resume, and the metrics.

    python tests/fsdp_grpo_run.py MODEL_DIR OUT_DIR RESULT STEPS [resume]
"""

from __future__ import annotations

import asyncio
import sys

import torch

from rollout.config import RolloutConfig
from trainer.config import GRPOConfig
from trainer.grpo import GRPOTrainer


def by_sample(request) -> float:
    return float(request.sample_index % 2) + 0.25 * (request.prompt_index % 3)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def main(model_dir: str, out_dir: str, result: str, steps: str, resume: str = "") -> None:
    config = GRPOConfig(
        model=model_dir, out=out_dir, steps=int(steps), prompts_per_step=4, samples_per_prompt=2,
        rollout=RolloutConfig(max_turns=1, max_new_tokens=8, max_model_len=768, temperature=1.0),
        micro_batch_size=3, lr=1e-2, seed=5, filter_groups=False, checkpoint_every=1, tis_cap=None, kl_beta=0.05,
    )  # fmt: skip
    trainer = GRPOTrainer(config, reward_fn=by_sample)
    first_grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capture_then_step(*args, **kwargs):  # the (reduced) gradient of the first update, every process
        if not first_grads:
            named = trainer.policy.model.named_parameters()
            first_grads.update({name: full(p.grad) for name, p in named if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture_then_step
    resumed: dict[str, torch.Tensor] = {}
    load = trainer.load_checkpoint

    def load_then_capture():
        history = load()
        resumed.update({k: v.detach().clone() for k, v in trainer.policy_state_dict().items()})
        return history

    trainer.load_checkpoint = load_then_capture
    history = asyncio.run(trainer.train(resume=bool(resume)))
    weights = {k: v.detach().clone() for k, v in trainer.policy_state_dict().items()}
    if trainer.is_main:
        processes, sharded = trainer.accelerator.num_processes, trainer.policy.sharded
        torch.save({"grads": first_grads, "weights": weights, "resumed": resumed, "history": history,
                    "processes": processes, "sharded": sharded}, result)  # fmt: skip
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])

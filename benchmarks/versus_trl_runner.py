"""TRL's side of ``benchmarks/versus_trl.py``: one GRPOTrainer run, inside the TRL virtualenv.

    .venvs/trl/bin/python benchmarks/versus_trl_runner.py SPEC.json

The spec (written by ``versus_trl.py``) names the model directory, the training records (the
prompts ``rallyrl train`` draws for the same seed, in the same order), the seed, the learning rate
and the settings matched to rallyrl's. The task's code is rallyrl's own, imported from the repository
(pure Python: ``tools.calculator`` for the tool, ``data.rewards.score_answer`` for the reward), so
both trainers are rewarded by the same function and call the same calculator.

What TRL 1.16 lacks for this task, and what this script does instead (said in the output too):

1. GRPOTrainer only runs tools with a chat template that renders an assistant message's structured
   ``tool_calls``; the embedded model's template writes the call inside the content, as the model
   generates it (``<tool_call>{json}</tool_call>``), and TRL refuses it ("The provided chat template
   does not support tool calling"). Here the template gets one more branch, in memory only, that
   renders ``tool_calls`` the way the model writes them; prompts and tool messages render exactly as
   before (checked against the tokens the benchmark expects).
2. It parses tool calls only for chat templates it knows (``add_response_schema``); the embedded
   template is not one. Here the tokenizer gets TRL's own Qwen3 response template, which reads the
   same ``<tool_call>{json}</tool_call>`` syntax.
3. A tool is a Python function whose JSON schema transformers derives from its docstring, which must
   describe every argument; the calculator's schema (the one the model was trained with) has no
   argument description, so the derived one would change every prompt. Here the function carries
   the calculator's exact schema and ``get_json_schema`` returns it.

Between steps it appends a line to ``steps.jsonl`` (step, sampled tokens, reward) and, every
``checkpoint_every`` steps, saves the model to ``checkpoints/step-N`` (written whole, then renamed),
as ``rallyrl train`` does; the benchmark reads its CPU time from outside.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

TOOL_CALLS_BRANCH = (
    "{% elif message.role == 'assistant' and message.tool_calls %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
)
"""Inserted before the template's catch-all branch: an assistant message with structured calls."""
CATCH_ALL = "{% else %}<|im_start|>{{ message.role }}"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def with_tool_calls(template: str) -> str:
    if CATCH_ALL not in template:
        raise SystemExit("versus_trl_runner: the model's chat template is not the embedded model's; nothing to extend")
    return template.replace(CATCH_ALL, TOOL_CALLS_BRANCH + CATCH_ALL, 1)


def schema_from_attribute() -> None:
    """Let a function carry its JSON schema (``fn.json_schema``): transformers derives one otherwise."""
    import transformers.utils.chat_parsing.response_parser as response_parser
    import transformers.utils.chat_template_utils as chat_template_utils

    derived = chat_template_utils.get_json_schema

    def get_json_schema(func: Any) -> dict:
        return getattr(func, "json_schema", None) or derived(func)

    chat_template_utils.get_json_schema = get_json_schema
    response_parser.get_json_schema = get_json_schema


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    threads = int(spec["threads"])
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    sys.path.insert(0, spec["repo_root"])
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from data.rewards import score_answer
    from tools.calculator import CalculatorError, evaluate, format_number

    schema_from_attribute()
    model_dir, out = Path(spec["model_dir"]), Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)

    def calculator(expression: str) -> str:
        """Exact arithmetic: + - * / // % ** and parentheses.

        Args:
            expression: the arithmetic expression
        """
        try:  # as rallyrl's CalculatorTool answers, "Error: ..." for a bad expression
            return format_number(evaluate(expression))
        except CalculatorError as exc:
            return f"Error: {exc}"

    calculator.json_schema = spec["calculator_schema"]

    def calc_reward(completions: list[list[dict]], ground_truth: list[str], **_: Any) -> list[float]:
        """rallyrl's default reward of the calc task: the last assistant message's answer, graded."""
        rewards = []
        for messages, truth in zip(completions, ground_truth, strict=True):
            last = next((m for m in reversed(messages) if m.get("role") == "assistant"), {})
            rewards.append(score_answer(last.get("content") or "", truth))
        return rewards

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = with_tool_calls(tokenizer.chat_template)
    tokenizer.response_template = qwen3_template
    rows = [json.loads(line) for line in Path(spec["records"]).read_text().splitlines() if line.strip()]
    rendered = tokenizer.apply_chat_template(
        rows[0]["prompt"], tools=[calculator], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if list(rendered) != spec["expected_prompt_ids"]:
        raise SystemExit("versus_trl_runner: TRL renders the prompt otherwise than rallyrl: no comparison")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    per_step = spec["prompts_per_step"] * spec["samples_per_prompt"]
    args = GRPOConfig(
        output_dir=str(out / "trl"),
        seed=spec["seed"],
        data_seed=spec["seed"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is on; off as rallyrl's is for a model this small
        learning_rate=spec["lr"],
        weight_decay=0.0,  # the optimizer and schedule are given below, as rallyrl's
        max_grad_norm=1.0,
        max_steps=spec["max_steps"],
        per_device_train_batch_size=per_step,  # one optimizer step per rollout of 16 prompts x 8 samples
        gradient_accumulation_steps=1,
        num_generations=spec["samples_per_prompt"],
        num_iterations=1,
        beta=0.0,
        epsilon=spec["eps_low"],
        epsilon_high=spec["eps_high"],
        loss_type="dapo",  # token-mean over the step's batch, as rallyrl's loss_aggregation: token-mean
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        max_completion_length=spec["max_completion_length"],
        generation_kwargs={"max_new_tokens": spec["max_new_tokens"]},  # per assistant turn, as rallyrl's
        max_tool_calling_iterations=spec["max_turns"] - 1,
        shuffle_dataset=False,  # the records in rallyrl's order: the same 16 prompts at each step
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    steps_path = out / "steps.jsonl"
    steps_path.unlink(missing_ok=True)

    class Checkpoints(TrainerCallback):
        """After each logged step: a line in steps.jsonl; every ``checkpoint_every`` steps, the model."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if not logs or "completions/mean_length" not in logs:
                return
            line = {
                "step": state.global_step,
                "sampled_tokens": logs["completions/mean_length"] * per_step,
                "reward_mean": logs.get("reward"),
                "tool_calls": logs.get("tools/call_frequency"),
            }
            with steps_path.open("a") as file:
                file.write(json.dumps(line) + "\n")
            if state.global_step % spec["checkpoint_every"] == 0:
                save(kwargs["model"], out / "checkpoints" / f"step-{state.global_step:06d}")

    def save(model: Any, directory: Path) -> None:
        partial = directory.with_name(directory.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        for name in TOKENIZER_FILES:  # the start's tokenizer, not the in-memory one extended above
            if (model_dir / name).exists():
                shutil.copy2(model_dir / name, partial / name)
        os.replace(partial, directory)

    # rallyrl's optimizer and schedule: AdamW, update s at lr x min(1, (s + 1) / (warmup + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    warmup = spec["warmup_steps"]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    dataset = datasets.Dataset.from_list(rows)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=calc_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[calculator],
        callbacks=[Checkpoints()],
        optimizers=(optimizer, schedule),
    )
    print(
        f"versus_trl_runner: trl {trl.__version__}, transformers {transformers.__version__}, torch "
        f"{torch.__version__}, {threads} thread(s); lr {spec['lr']}, seed {spec['seed']}",
        flush=True,
    )
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])

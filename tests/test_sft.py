"""Supervised fine-tuning: calc traces, the rollout token layout, the masked loss, a short run."""

from __future__ import annotations

import copy

import orjson
import pytest
import torch

from data.rewards import score_answer
from data.schema import validate_record
from data.synthetic import calc_trace, direct_answer_trace, make_calc_records, make_calc_sft_records
from data.tiny_model import TinyModelConfig, build_tiny_model
from rollout.parsers import parse_hermes
from rollout.request import AsyncRolloutRequest, FinishReason, RequestState
from rollout.tokens import load_tokenizer
from tools.calculator import evaluate, format_number
from trainer.policy_model import enable_checkpointing
from trainer.sft import (
    RECIPES,
    Batch,
    Example,
    SFTConfig,
    calc_chat,
    collate,
    load_examples,
    run_recipe,
    run_sft,
    sft_loss,
    tokenize_conversation,
)

FIXTURE_MODEL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def chat(tokenizer):
    return calc_chat(tokenizer)[0]


@pytest.fixture
def model(tokenizer):
    return build_tiny_model(tokenizer, FIXTURE_MODEL).train()


# ----- the calc trace ---------------------------------------------------------------------------


def test_trace_calls_the_calculator_on_the_question_as_written_and_boxes_its_result():
    for record in make_calc_records(30, seed=5):
        trace = calc_trace(record)
        assert trace[: len(record.prompt)] == record.prompt
        call, tool, final = trace[len(record.prompt) :]
        assert [call["role"], tool["role"], final["role"]] == ["assistant", "tool", "assistant"]
        turn = parse_hermes(call["content"])
        assert turn.content == "" and len(turn.calls) == 1
        assert turn.calls[0].name == "calculator"
        expression = turn.calls[0].arguments["expression"]
        assert expression in record.prompt[-1]["content"]  # copyable verbatim from the question
        assert tool["content"] == format_number(evaluate(expression)) == record.ground_truth
        assert final["content"] == f"\\boxed{{{record.ground_truth}}}"
        assert score_answer(final["content"], record.ground_truth) == 1.0


def test_trace_call_is_json_with_default_separators():
    record = make_calc_records(1, seed=0)[0]
    assert calc_trace(record)[2]["content"] == (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "616 + 388 * 873"}}</tool_call>'
    )


def test_sft_records_hold_the_trace_and_pass_validation():
    records = make_calc_sft_records(10, seed=3)
    for record, plain in zip(records, make_calc_records(10, seed=3), strict=True):
        assert record.prompt == calc_trace(plain)
        assert record.ground_truth == plain.ground_truth
        assert validate_record(record.to_dict(), index=record.index) == record


def test_tool_call_share_mixes_direct_answers_into_the_same_problems():
    mixed = make_calc_sft_records(400, seed=3, tool_call_share=0.3)
    plain = make_calc_records(400, seed=3)
    calls = 0
    for record, problem in zip(mixed, plain, strict=True):
        if record.prompt == calc_trace(problem):
            calls += 1
        else:
            assert record.prompt == direct_answer_trace(problem)
            assert record.prompt[-1]["content"] == f"\\boxed{{{problem.ground_truth}}}"
    assert 90 <= calls <= 150  # about 30 % of 400
    assert make_calc_sft_records(400, seed=3, tool_call_share=0.3) == mixed


def test_tool_call_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="tool_call_share"):
        make_calc_sft_records(1, tool_call_share=1.5)


# ----- tokenisation in the rollout layout -------------------------------------------------------


def test_conversation_tokens_equal_a_full_render_minus_the_final_glue(chat):
    for record in make_calc_sft_records(5, seed=0):
        example = tokenize_conversation(chat, record.prompt)
        full = chat.encode(chat.render(record.prompt))
        assert example.input_ids == full[: len(example.input_ids)]
        assert full[len(example.input_ids) :] == chat.turn_close_ids[1:]
        assert chat.check_consistency(record.prompt, example.input_ids).ok


def test_mask_is_one_exactly_on_assistant_content_and_its_stop_token(chat):
    trace = make_calc_sft_records(1, seed=0)[0].prompt
    example = tokenize_conversation(chat, trace)
    stop = chat.turn_close_ids[0]
    runs, current = [], []  # maximal runs of mask-1 tokens
    for token, mask in zip(example.input_ids, example.loss_mask, strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    assistant = [m["content"] for m in trace if m["role"] == "assistant"]
    assert runs == [[*chat.encode(text), stop] for text in assistant]
    prompt = [m for m in trace if m["role"] != "assistant"][:2]
    assert example.input_ids[: len(chat.prompt_ids(prompt))] == chat.prompt_ids(prompt)


def test_a_trajectory_file_is_used_as_is(chat, tmp_path):
    request = AsyncRolloutRequest("r-0", 0, 0, [{"role": "user", "content": "What is 2 + 2?"}])
    request.prompt_ids = chat.prompt_ids(request.messages)
    request.append_generated([5, 6, chat.turn_close_ids[0]], [-0.1, -0.2, -0.3], 0)
    request.append_context([7, 8])
    request.append_generated([9, chat.turn_close_ids[0]], [-0.1, -0.2], 0)
    request.finish(FinishReason.STOP)
    request.transition(RequestState.COMPLETED)
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(orjson.dumps(request.to_record()) + b"\n")

    [example] = load_examples(SFTConfig(data=str(path), num_examples=0), chat)
    assert example.input_ids == request.prompt_ids + request.response_ids
    assert example.loss_mask == [0] * len(request.prompt_ids) + request.loss_mask


def test_trajectories_below_min_reward_are_left_out(chat, tmp_path):
    lines = []
    for reward in (0.0, 1.0):
        request = AsyncRolloutRequest(f"r-{reward}", 0, 0, [{"role": "user", "content": "Hi"}])
        request.prompt_ids = chat.prompt_ids(request.messages)
        request.append_generated([5, chat.turn_close_ids[0]], [-0.1, -0.2], 0)
        request.rewards.final = reward
        request.finish(FinishReason.STOP)
        request.transition(RequestState.COMPLETED)
        lines.append(orjson.dumps(request.to_record()))
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert len(load_examples(SFTConfig(data=str(path), num_examples=0, min_reward=0.5), chat)) == 1


# ----- the loss ---------------------------------------------------------------------------------


def test_loss_ignores_targets_outside_the_mask(chat, model):
    examples = [tokenize_conversation(chat, r.prompt) for r in make_calc_sft_records(2, seed=0)]
    batch = collate(examples, chat.tokenizer.pad_token_id)
    untrained = ~batch.loss_mask.bool()
    untrained[:, : batch.shared_prefix + 1] = False  # the shared prefix is the same in every row
    changed = torch.where(untrained, (batch.input_ids + 3) % model.config.vocab_size, batch.input_ids)
    with torch.no_grad():
        loss = sft_loss(model, batch)
        assert sft_loss(model, Batch(changed, batch.loss_mask, batch.shared_prefix)) != loss  # inputs changed
        logits = model(input_ids=batch.input_ids).logits[:, :-1]
    mask = batch.loss_mask[:, 1:].bool()
    expected = torch.nn.functional.cross_entropy(logits[mask], batch.input_ids[:, 1:][mask])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_changing_tool_output_tokens_does_not_change_the_loss(chat, model):
    """Cut after the tool result: its tokens are in the input, but only the call before them is trained."""

    def loss_for(result: str) -> float:
        trace = copy.deepcopy(make_calc_sft_records(1, seed=0)[0].prompt)
        trace[-2]["content"] = result
        example = tokenize_conversation(chat, trace)
        cut = len(example.input_ids) - len(chat.encode(trace[-1]["content"])) - 1  # before the final answer
        assert chat.decode(example.input_ids[:cut]).endswith(
            f"{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        assert not any(example.loss_mask[cut - 20 : cut])
        batch = collate([Example(example.input_ids[:cut], example.loss_mask[:cut])], chat.tokenizer.pad_token_id)
        with torch.no_grad():
            return sft_loss(model, batch).item()

    assert loss_for("339340") == loss_for("999999")


def loss_and_grads(model, batch: Batch, chunk_tokens: int = 1024) -> tuple[float, list[torch.Tensor]]:
    """The SFT loss of ``batch`` and every parameter's gradient, from zeroed gradients."""
    model.zero_grad()
    loss = sft_loss(model, batch, chunk_tokens)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_shared_prefix_forward_gives_the_full_forward_loss_and_gradients(chat, model):
    examples = [tokenize_conversation(chat, r.prompt) for r in make_calc_sft_records(4, seed=0)]
    batch = collate(examples, chat.tokenizer.pad_token_id)
    assert batch.shared_prefix > 300  # the system prompt with the tool schema

    shared_loss, shared_grads = loss_and_grads(model, Batch(batch.input_ids, batch.loss_mask, batch.shared_prefix))
    full_loss, full_grads = loss_and_grads(model, Batch(batch.input_ids, batch.loss_mask, 0))
    assert shared_loss == pytest.approx(full_loss, rel=1e-5)
    for a, b in zip(shared_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(chat, model):
    examples = [tokenize_conversation(chat, r.prompt) for r in make_calc_sft_records(3, seed=2)]
    batch = collate(examples, chat.tokenizer.pad_token_id)
    batch = Batch(batch.input_ids, batch.loss_mask, 0)  # (checkpointed layers cannot share a cached prefix)
    checkpointed = copy.deepcopy(model)
    enable_checkpointing(checkpointed)
    loss_a, grads_a = loss_and_grads(checkpointed, batch, chunk_tokens=7)
    loss_b, grads_b = loss_and_grads(model, batch, chunk_tokens=7)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_padding_on_the_right_does_not_change_a_row_s_loss(chat, model):
    examples = sorted(
        (tokenize_conversation(chat, r.prompt) for r in make_calc_sft_records(6, seed=1)),
        key=lambda e: len(e.input_ids),
    )
    short, long = examples[0], examples[-1]
    pad = chat.tokenizer.pad_token_id
    padded = collate([short, long], pad)
    assert padded.input_ids.shape[1] > len(short.input_ids)
    with torch.no_grad():
        alone = sft_loss(model, collate([short], pad)).item()
        assert sft_loss(model, Batch(padded.input_ids[:1], padded.loss_mask[:1])).item() == pytest.approx(
            alone, rel=1e-5
        )


def test_a_few_sft_steps_reduce_the_loss_on_a_fixed_batch(chat, model):
    examples = [tokenize_conversation(chat, r.prompt) for r in make_calc_sft_records(4, seed=0)]
    batch = collate(examples, chat.tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = sft_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0]


# ----- a whole run ------------------------------------------------------------------------------


def test_run_sft_writes_loadable_checkpoints_a_log_and_an_eval_history(tmp_path):
    sizes = {k: getattr(FIXTURE_MODEL, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size")}
    config = SFTConfig(
        **sizes,
        num_layers=FIXTURE_MODEL.num_layers,
        num_examples=16,
        steps=4,
        batch_size=4,
        warmup_steps=1,
        eval_every=2,
        eval_prompts=2,
        log_every=2,
        out=str(tmp_path / "sft"),
        progress=False,
    )
    history = run_sft(config)

    assert [entry["step"] for entry in history] == [2, 4]
    for entry in history:
        assert 0.0 <= entry["accuracy"] <= 1.0 and 0.0 <= entry["tool_call_rate"] <= 1.0
        assert entry["consistency_failures"] == 0
    checkpoint = tmp_path / "sft" / "step-4"
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in checkpoint.iterdir()
    }
    assert load_tokenizer(checkpoint).chat_template
    assert not list((tmp_path / "sft").glob(".*"))  # no temporary directories left behind
    kinds = [orjson.loads(line)["kind"] for line in (tmp_path / "sft" / "sft_log.jsonl").read_bytes().splitlines()]
    assert kinds == ["config", "train", "eval", "train", "eval"]


def test_stop_accuracy_ends_the_run_at_the_first_evaluation_that_reaches_it_and_exports_it(tmp_path, monkeypatch):
    accuracies = iter([0.1, 0.5, 0.9])

    async def scripted_evaluation(*args, **kwargs):  # stands in for the held-out rollouts
        metrics = {"tool_call_rate": 1.0, "well_formed_calls": 1.0, "exact_calls": 1.0, "eval_s": 0.0}
        return {"accuracy": next(accuracies), **metrics}

    monkeypatch.setattr("trainer.sft.evaluate_greedy", scripted_evaluation)
    sizes = {k: getattr(FIXTURE_MODEL, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size")}
    config = SFTConfig(
        **sizes, num_layers=FIXTURE_MODEL.num_layers, num_examples=8, steps=6, batch_size=2, warmup_steps=0,
        eval_every=2, eval_prompts=2, stop_accuracy=0.4, out=str(tmp_path / "sft"),
        export=str(tmp_path / "shipped"), progress=False,
    )  # fmt: skip
    history = run_sft(config)

    assert [entry["step"] for entry in history] == [2, 4]
    assert not (tmp_path / "sft" / "step-6").exists()
    assert_exported(tmp_path / "shipped", tmp_path / "sft" / "step-4")
    assert not list(tmp_path.glob("shipped.partial*"))


def test_a_recipe_runs_its_stages_each_from_the_last_checkpoint_and_exports_the_last(tmp_path, monkeypatch):
    sizes = {k: getattr(FIXTURE_MODEL, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size")}
    first = {**sizes, "num_layers": FIXTURE_MODEL.num_layers, "steps": 2, "schedule_steps": 4}
    monkeypatch.setitem(RECIPES, "two-stage", (first, {"steps": 1, "tool_call_share": 0.5, "seed": 3}))
    out = tmp_path / "recipe"
    run_recipe(
        "two-stage", out, tmp_path / "shipped", num_examples=8, batch_size=2, warmup_steps=0, eval_every=2,
        eval_prompts=0, progress=False,
    )  # fmt: skip

    configs = [orjson.loads((out / f"stage-{n}" / "sft_log.jsonl").read_bytes().splitlines()[0]) for n in (1, 2)]
    assert configs[0]["model"] is None and configs[0]["schedule_steps"] == 4
    assert configs[1]["model"] == str(out / "stage-1" / "step-2") and configs[1]["tool_call_share"] == 0.5
    assert_exported(tmp_path / "shipped", out / "stage-2" / "step-1")


def assert_exported(export, checkpoint) -> None:
    """The export is the checkpoint re-expressed with heads of 32 (``export_head_dim``): the same logits."""
    from transformers import AutoModelForCausalLM

    shipped, trained = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                        for d in (export, checkpoint))  # fmt: skip
    assert (shipped.config.head_dim, shipped.config.hidden_size) == (32, FIXTURE_MODEL.num_heads * 32)
    ids = torch.randint(4, 105, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(shipped(ids).logits, trained(ids).logits, atol=1e-4)
    assert (export / "tokenizer.json").read_bytes() == (checkpoint / "tokenizer.json").read_bytes()


def test_an_unknown_recipe_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="known recipes: tiny-calc"):
        run_recipe("nope", tmp_path)


def test_stop_accuracy_needs_evaluations():
    with pytest.raises(ValueError, match="stop_accuracy"):
        SFTConfig(stop_accuracy=0.5, eval_prompts=0)


def test_eval_seed_must_not_be_the_training_seed():
    with pytest.raises(ValueError, match="eval_seed"):
        SFTConfig(seed=7, eval_seed=7)


def test_a_conversation_without_an_assistant_turn_is_refused(chat):
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(chat, [{"role": "user", "content": "Hi"}])


def test_a_conversation_file_loads_through_the_record_schema(chat, tmp_path):
    path = tmp_path / "conversations.jsonl"
    records = make_calc_sft_records(2, seed=0)
    path.write_bytes(b"".join(orjson.dumps(r.to_dict()) + b"\n" for r in records))
    examples = load_examples(SFTConfig(data=str(path), num_examples=0), chat)
    assert examples == [tokenize_conversation(chat, r.prompt) for r in records]

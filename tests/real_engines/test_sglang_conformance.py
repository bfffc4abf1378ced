"""``rallyrl serve`` answers as a real SGLang 0.5.23 answers: the requests of
``tests/fixtures/record_sglang.py`` (the ones the recorded fixtures hold) sent to both servers of the
embedded model, the answers compared field by field: status codes, keys in their order, JSON types,
``finish_reason``, ``meta_info``, ``output_ids`` (the EOS included on stop), batches, logprob triples,
weight versions, the OpenAI shapes, streams event by event, and the errors for bad input. Greedy
decoding gives the same tokens on both (fp32; logprobs within 1e-4).

Where rallyrl serve differs on purpose, ``DIFFERENCES`` (whole answers) and ``FIELD_DIFFERENCES``
(single fields) say why; those answers are checked against what rallyrl serve does instead.

Both servers are this module's own: SGLang started with the recorder's flags (the hermes tool-call
parser, the model's whole context), ``rallyrl serve`` in a subprocess with the same parser.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from data.tiny_model import EMBEDDED_MODEL
from rollout.serve.processes import serve_processes
from tests.fixtures.record_sglang import (
    CALC_TASK,
    CALCULATOR,
    QUESTION,
    SERVER_FLAGS,
    Case,
    Reply,
    abort_scenario,
    cases,
    chat_ids,
    fatal_cases,
    pause_scenario,
    send,
)
from tests.real_engines.conftest import SGLANG_FLAGS, reset_sglang

LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Difference:
    """An answer of rallyrl serve that differs from SGLang's on purpose: why, and its status."""

    reason: str
    status: int


DIFFERENCES = {
    "error_generate_empty_prompt_in_batch": Difference(
        "SGLang 0.5.23 generates from an empty prompt in a batch (prompt_tokens 0); rallyrl serve refuses it "
        "with a 400, as SGLang refuses an empty single prompt", 400),
    "error_generate_sampling_list_for_one_prompt": Difference(
        "SGLang answers 500 Internal Server Error (text/plain) to a list of sampling_params for one prompt; "
        "rallyrl serve says what is wrong with a 400", 400),
    "error_generate_sampling_list_length": Difference(
        "SGLang answers 500 Internal Server Error (text/plain) to sampling_params of another length than the "
        "batch; rallyrl serve says what is wrong with a 400", 400),
    "generate_logprob_start_len": Difference(
        "the engine returns the logprob of each generated token, not of the prompt: rallyrl serve refuses "
        "logprob_start_len other than -1 with a 400 rather than answer without them", 400),
    "generate_top_logprobs": Difference(
        "the engine returns the logprob of the sampled token only: rallyrl serve refuses top_logprobs_num "
        "above 0 with a 400", 400),
    "generate_min_new_tokens": Difference(
        "the engine cannot hold back its stop tokens: rallyrl serve refuses min_new_tokens above 0 with a 400",
        400),
    "pause_generation_in_place": Difference(
        "the engine cannot hold a request half-way: rallyrl serve refuses mode in_place with a 400 (abort and "
        "retract abort what runs; the clients resume it)", 400),
    "error_generate_out_of_vocabulary": Difference(
        "SGLang 0.5.23 dies on a token id outside the vocabulary (IndexError in the embedding; the connection "
        "closes unanswered and every later request is refused); rallyrl serve answers 400", 400),
}  # fmt: skip
"""Answers of rallyrl serve that differ from SGLang's: only their status is compared."""

FIELD_DIFFERENCES = {
    ("get_model_info*", "embedding"): "SGLang's description of embedding support; rallyrl serve serves no embeddings",
    ("get_model_info*", "served_model_name"): "rallyrl serve's default served name is the model directory's name "
    "(SGLang's is its path); --served-model-name sets it",
    ("get_server_info", "served_model_name"): "as in get_model_info",
    ("models", "data[0].id"): "the served model name, as in get_model_info",
    ("models", "data[0].owned_by"): '"rallyrl" rather than "sglang"',
    ("completion_no_model", "model"): 'without "model" SGLang answers "default"; rallyrl serve its served name',
}  # fmt: skip
"""Single fields (``(case pattern, field path)``) whose values differ on purpose; keys only SGLang has
are listed here too."""

SAMPLED = {
    "generate_seeded": "sampling with a seed: each engine has a random generator of its own",
    "chat_completion_tool_calls": "SGLang 0.5.23 renders each tool with an added \"defer_loading\": null, so "
    "the prompt and the tokens differ; rallyrl serve renders tools as the client sent them, as rollouts do",
    "chat_completion_stream_tool_calls": "as chat_completion_tool_calls; SGLang also streams the arguments in "
    "pieces where rallyrl serve sends them whole",
}  # fmt: skip
"""Cases whose tokens differ between the engines: their answers are compared by shape only."""

VOLATILE = {"id", "created", "e2e_latency", "response_sent_to_client_ts", "cached_tokens", "cached_tokens_details"}
"""Keys whose values are not compared (random, clocks, cache hits)."""
SERVER_INFO_KEYS = ("model_path", "tokenizer_path", "context_length", "served_model_name", "weight_version",
                    "tool_call_parser", "tp_size", "dp_size", "disaggregation_mode", "status", "version")  # fmt: skip
"""Of SGLang's ~550 server-info keys, the ones clients read (sglang-router: tests/fixtures/sglang/ROUTER.md)."""


@pytest.fixture(scope="module")
def sglang(_sglang_scratch) -> str:
    """SGLang of the embedded model with the recorder's flags (``SGLANG_FLAGS`` holds ``SERVER_FLAGS``),
    reset once for the module: its cases run in order on it as on ``rallyrl``, and change its weight version."""
    assert set(SERVER_FLAGS) <= set(SGLANG_FLAGS)
    reset_sglang(_sglang_scratch)
    return _sglang_scratch


@pytest.fixture(scope="module")
def rallyrl(engine_logs) -> Iterator[str]:
    with serve_processes(EMBEDDED_MODEL, engine_logs, 1, "--tool-parser", "hermes") as [server]:
        yield server.url


# ----- comparing answers -----------------------------------------------------------------------------


def differences(case: str, ours: Any, theirs: Any, path: str = "", values: bool = True) -> list[str]:
    """Every place where two JSON answers differ: keys (and their order), JSON types, list lengths and,
    with ``values``, the values themselves (floats within LOGPROB_TOLERANCE; VOLATILE keys and
    FIELD_DIFFERENCES excepted)."""
    where = path or "the answer"
    key = path.rsplit(".", 1)[-1].split("[")[0]
    if _allowed(case, path):
        return []
    if isinstance(theirs, dict) and isinstance(ours, dict):
        found = []
        theirs_keys = [k for k in theirs if k in ours or not _allowed(case, _join(path, k))]
        if list(ours) != theirs_keys:
            found.append(f"{where}: keys {list(ours)} != SGLang's {theirs_keys}")
        for k in theirs_keys:
            if k in ours:
                found += differences(case, ours[k], theirs[k], _join(path, k), values)
        return found
    if isinstance(theirs, list) and isinstance(ours, list):
        if len(ours) != len(theirs) and (values or key in ("tool_calls", "choices", "data")):
            return [f"{where}: {len(ours)} items != SGLang's {len(theirs)}"]
        pairs = zip(ours, theirs, strict=False) if values else zip(ours[:1], theirs[:1], strict=False)
        return [d for i, (a, b) in enumerate(pairs) for d in differences(case, a, b, f"{path}[{i}]", values)]
    if _json_type(ours) != _json_type(theirs) and not (key in VOLATILE and None in (ours, theirs)):
        return [f"{where}: {_json_type(ours)} {ours!r:.80} != SGLang's {_json_type(theirs)} {theirs!r:.80}"]
    if not values or key in VOLATILE:
        return []
    if isinstance(theirs, float) or isinstance(ours, float):
        close = math.isclose(ours, theirs, abs_tol=LOGPROB_TOLERANCE)
        return [] if close else [f"{where}: {ours} != SGLang's {theirs} (beyond {LOGPROB_TOLERANCE})"]
    return [] if ours == theirs else [f"{where}: {ours!r:.200} != SGLang's {theirs!r:.200}"]


def _allowed(case: str, path: str) -> bool:
    return any(fnmatch.fnmatch(case, c) and p == path for c, p in FIELD_DIFFERENCES)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value) if value is None else "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def comparable(case: Case, reply: Reply) -> Any:
    """What of an answer is compared: its body, the server-info keys clients read, the shape of an
    error (its message is the server's own wording), an SSE stream's events."""
    body = reply.body
    if case.name == "get_server_info":
        states = [{k: state.get(k) for k in ("model_path", "weight_version")} for state in body["internal_states"]]
        release = "<release>" if isinstance(body.get("version"), str) else None  # "0.5.23" / "rallyrl-0.1.0"
        return {**{k: body.get(k) for k in SERVER_INFO_KEYS}, "version": release, "internal_states": states}
    if reply.status and reply.status >= 400 and isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, str):
            return {**body, "error": "<message>"}
        if isinstance(error, dict):
            return {**body, "error": {**error, "message": "<message>"}}
        if isinstance(body.get("message"), str):
            return {**body, "message": "<message>"}
    return body


def request_ids(reply: Reply) -> list[str]:
    answers = reply.body if isinstance(reply.body, list) else [reply.body]
    return [answer["meta_info"]["id"] for answer in answers]


def content_kind(reply: Reply) -> str:
    """JSON, an SSE stream, or text (an empty body included)."""
    kind = reply.content_type or ""
    return "json" if kind.startswith("application/json") else "sse" if kind.startswith("text/event-stream") else "text"


def stream_differences(case: str, ours: list[Any], theirs: list[Any], values: bool) -> list[str]:
    """Streams compared as SGLang's own vary from run to run (under load it sends some tokens
    together, or only the final event): each ends with ``[DONE]``; per prompt or choice, the final
    event and the text of all events agree; every other event has the shape of one of SGLang's.
    ``response_sent_to_client_ts`` is on the first event SGLang sends for a request, whichever that
    is, so its presence is not compared."""
    if ours[-1:] != ["[DONE]"] or theirs[-1:] != ["[DONE]"]:
        return [f"the streams do not both end with [DONE]: {ours[-1:]} / {theirs[-1:]}"]
    ours, theirs = [_without_timestamp(e) for e in ours[:-1]], [_without_timestamp(e) for e in theirs[:-1]]
    (our_finals, our_texts), (their_finals, their_texts) = stream_parts(ours), stream_parts(theirs)
    found = differences(case, our_finals, their_finals, "final events", values)
    if values and our_texts != their_texts:
        found.append(f"streamed text {our_texts} != SGLang's {their_texts}")
    their_steps = [event for event in theirs if not _final(event)]
    for event in (e for e in ours if not _final(e) and their_steps):
        if all(differences(case, event, their_step, "event", False) for their_step in their_steps):
            found.append(f"event {event!r:.300} is like none of SGLang's")
    return found


def _final(event: dict[str, Any]) -> bool:
    finish = event["choices"][0]["finish_reason"] if "choices" in event else event["meta_info"]["finish_reason"]
    return finish is not None


def _without_timestamp(event: dict[str, Any]) -> dict[str, Any]:
    if "meta_info" not in event:
        return event
    return {**event, "meta_info": {k: v for k, v in event["meta_info"].items() if k != "response_sent_to_client_ts"}}


def stream_parts(events: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """The final event of each prompt or choice of a stream, and the text its pieces add up to
    (a final OpenAI event's own piece is left out of it: SGLang may have sent more with it;
    ``/generate`` chunks carry the whole text so far)."""
    finals: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for event in events:
        if "choices" in event:
            [choice] = event["choices"]
            index = str(choice["index"])
            piece = "text" if "text" in choice else "content"
            texts[index] = texts.get(index, "") + ((choice if piece == "text" else choice["delta"]).get(piece) or "")
            if choice["finish_reason"] is not None:
                if piece == "text":
                    choice = {**choice, "text": "<piece>"}
                elif "content" in choice["delta"]:
                    choice = {**choice, "delta": {**choice["delta"], "content": "<piece>"}}
                finals[index] = {**event, "choices": [choice]}
        elif event["meta_info"]["finish_reason"] is not None:
            finals[str(event.get("index", 0))] = event
    return dict(sorted(finals.items())), dict(sorted(texts.items()))


def assert_same_answer(case: Case, ours: Reply, theirs: Reply) -> None:
    assert ours.status == theirs.status, f"{case.name}: status {ours.status} != SGLang's {theirs.status}: " \
                                         f"{ours.body!r:.300} / {theirs.body!r:.300}"  # fmt: skip
    assert content_kind(ours) == content_kind(theirs), f"{case.name}: {ours.content_type} != {theirs.content_type}"
    values = case.name not in SAMPLED
    mine, sglangs = comparable(case, ours), comparable(case, theirs)
    if content_kind(ours) == "sse":
        found = stream_differences(case.name, mine, sglangs, values)
    else:
        found = differences(case.name, mine, sglangs, "", values)
    assert not found, f"{case.name}: rallyrl serve differs from SGLang:\n  " + "\n  ".join(found)


# ----- the tests ------------------------------------------------------------------------------------------

CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_rallyrl_serve_answers_like_sglang(case, sglang, rallyrl):
    theirs, ours = send(sglang, case), send(rallyrl, case)
    try:
        if case.name in DIFFERENCES:
            assert ours.status == DIFFERENCES[case.name].status, ours.body
            assert theirs.status != ours.status, f"SGLang now answers {theirs.status}: drop the difference"
            return
        assert_same_answer(case, ours, theirs)
        if case.path == "/generate" and "rid" in (case.body or {}):  # a given rid comes back (numbered in a batch)
            assert request_ids(ours) == request_ids(theirs)
    finally:
        if case.path == "/pause_generation":  # never leave a server paused for the next case
            for url in (sglang, rallyrl):
                send(url, Case("", "", "/continue_generation", {}))


@pytest.mark.parametrize("case", fatal_cases(), ids=[case.name for case in fatal_cases()])
def test_rallyrl_serve_refuses_what_ends_sglang(case, rallyrl):
    ours = send(rallyrl, case)
    assert ours.status == DIFFERENCES[case.name].status
    assert "error" in ours.body
    assert send(rallyrl, Case("", "", "/health", method="GET")).status == 200


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": chat_ids(QUESTION), "sampling_params": {"temperature": 0, "max_new_tokens": 48}},
        {"input_ids": chat_ids(CALC_TASK, [CALCULATOR]), "sampling_params": {"temperature": 0, "max_new_tokens": 96}},
        {"text": "12*34=", "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}},
    ],
    ids=["question", "tool_call", "text_past_eos"],
)
def test_greedy_decoding_gives_sglangs_tokens_and_logprobs(body, sglang, rallyrl):
    case = Case("greedy", "", "/generate", {**body, "return_logprob": True})
    theirs, ours = send(sglang, case).body, send(rallyrl, case).body
    assert ours["output_ids"] == theirs["output_ids"]
    assert ours["meta_info"]["finish_reason"] == theirs["meta_info"]["finish_reason"]
    gaps = [abs(a[0] - b[0]) for a, b in zip(ours["meta_info"]["output_token_logprobs"],
                                             theirs["meta_info"]["output_token_logprobs"], strict=True)]  # fmt: skip
    assert max(gaps) <= LOGPROB_TOLERANCE


def test_abort_request_ends_running_requests_as_sglang_does(sglang, rallyrl):
    theirs, ours = abort_scenario(sglang), abort_scenario(rallyrl)
    for role in ("generate", "abort_request"):
        assert ours.exchanges[role]["status"] == theirs.exchanges[role]["status"] == 200, role
    aborted = [s.exchanges["generate"]["body"] for s in (ours, theirs)]
    assert aborted[0]["meta_info"]["finish_reason"] == aborted[1]["meta_info"]["finish_reason"]
    assert aborted[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert not differences("abort", aborted[0], aborted[1], "", values=False)
    last = [s.exchanges["generate_stream"]["body"][-2] for s in (ours, theirs)]
    assert last[0]["meta_info"]["finish_reason"] == last[1]["meta_info"]["finish_reason"]
    assert [s.exchanges["generate_stream"]["body"][-1] for s in (ours, theirs)] == ["[DONE]", "[DONE]"]


def test_pause_generation_aborts_running_requests_and_holds_new_ones_as_sglang_does(sglang, rallyrl):
    theirs, ours = pause_scenario(sglang), pause_scenario(rallyrl)
    assert ours.held and theirs.held, "a request sent while paused waits for /continue_generation"
    for role in ("pause_generation", "continue_generation", "generate_while_paused"):
        assert ours.exchanges[role]["status"] == theirs.exchanges[role]["status"] == 200, role
        assert not differences(role, ours.exchanges[role]["body"], theirs.exchanges[role]["body"], "", False)
    finish = [s.exchanges["generate_stream"]["body"][-2]["meta_info"]["finish_reason"] for s in (ours, theirs)]
    assert finish[0] == finish[1]
    assert finish[0]["type"] == "abort"

"""The rollout side of the config tree: per-request limits and sampling (``RolloutConfig``), the
judge, and the root configs of ``rallyrl rollout`` and ``rallyrl serve``.

Light on purpose: no torch, sympy or math-verify, so ``rallyrl config --show`` is quick. Each
default is written once, here or in ``rollout/engines/config.py`` (engines) and
``trainer/config.py`` (training, evaluation); YAML files and flags override them
(``data/config_tree.py``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal

from data.config_tree import check_fields
from rollout.engines.config import EngineConfig, LocalEngineConfig
from rollout.event_loop import EventLoop
from rollout.event_loop import resolve as resolve_event_loop
from rollout.gateway_config import GatewayConfig
from rollout.limits import ServeLimits


@dataclass
class RolloutConfig:
    """Every per-request limit and sampling setting of a rollout, and its concurrency."""

    # --- turns and token budgets ---
    max_turns: int = 8
    """Most assistant turns per request; a request still calling tools after it ends as max_turns."""
    max_new_tokens: int = 256
    """Most tokens generated in one assistant turn (SGLang's ``max_new_tokens``)."""
    max_response_tokens: int | None = None
    """Most tokens after the prompt over the whole conversation (generated, template glue and tool
    output alike; TRL's ``max_completion_length``, verl's ``response_length``). A request that reaches
    it ends with ``length``. None: only ``max_new_tokens`` and ``max_model_len`` bound it."""
    max_model_len: int = 2048
    """Most tokens in the whole conversation (prompt + every turn); the engine's context limit
    unless ``engine.local.max_model_len`` says otherwise."""

    # --- sampling (SGLang's names) ---
    temperature: float = 1.0
    """Sampling temperature (0: greedy). The trainer divides its logits by the same value."""
    top_p: float = 1.0
    """Nucleus cut, in (0, 1]."""
    top_k: int = -1
    """Keep only the k most likely tokens (0 or less: no cut). Logprobs stay those of the full
    temperature-scaled distribution, so TIS (``tis_cap``) corrects the cut."""
    seed: int | None = None
    """With a seed, each turn samples with its own seed derived from (seed, prompt index, sample
    index, turn): the same tokens however requests are batched or split over processes. Training
    sets it per step from its own ``seed``."""

    # --- tools ---
    tool_parser: str = "qwen25"
    """Parser of the model's tool calls, SGLang's ``--tool-call-parser`` names: qwen25/hermes
    (``<tool_call>{json}</tool_call>``), qwen3_coder, llama3, mistral, deepseekv3, deepseekv31,
    gpt-oss, kimi_k2, glm45 (``rollout/tool_parsers/``)."""
    reasoning_parser: str = "none"
    """Splits each assistant turn into reasoning and content, SGLang's ``--reasoning-parser`` names:
    none, qwen3, qwen3-thinking, deepseek-r1, deepseek-v3, glm45, kimi, gpt-oss, mistral
    (``rollout/reasoning.py``). Rewards, answers and tool calls read the content; the tokens stay as
    generated."""
    max_parallel_calls: int = 4
    """Most tool calls executed per turn; further calls in that turn are answered with an error."""
    tool_timeout_s: float = 30.0
    """Wall-clock limit of one tool call (execute); a slower call is answered with an error."""
    max_tool_response_chars: int = 2000
    """Longer tool outputs keep their head and tail with a marker in the middle."""
    tool_reward_timeout_s: float = 30.0
    """Limit of each tool's create, calc_reward and release."""

    # --- the user's turns (interactions) ---
    max_user_turns: int | None = None
    """Most user turns an interaction may append (verl's ``max_user_turns``); a request whose user
    still talks after them ends as max_turns. None: only ``max_turns`` bounds them."""
    interaction_timeout_s: float = 60.0
    """Wall-clock limit of one user turn (``generate_response``); start, score and finalize use
    ``tool_reward_timeout_s``. A slower turn ends its request with an error."""

    # --- the batch ---
    max_concurrency: int = 64
    """Requests in flight at once (per process); the rest wait for a slot. With the embedded
    engine, ``engine.local.max_batch_size`` bounds how many of them decode together."""
    check_consistency: bool = True
    """Re-render each finished conversation and record any token difference (``consistency_diff``)."""
    content_special_tokens: Literal["text", "tokens"] = "text"
    """How the string of a special or added token (``<|im_end|>``, ``<tool_call>``, the EOS string ...) in
    the content of a system, user or tool message (the record's prompt, a user's or an environment's turn, a
    tool output) is tokenized. text: as the ordinary tokens of its characters, so no content can forge a
    turn boundary or a tool call in the model's context; tokens: as that token's id (what
    ``apply_chat_template`` does, and verl and TRL unless told). The chat template's own markers are its
    tokens, and the model's turns its own ids, either way."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("max_turns", "max_parallel_calls", "max_tool_response_chars", "max_new_tokens", "max_model_len",
                     "max_concurrency"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise ValueError(f"RolloutConfig.max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if self.max_user_turns is not None and self.max_user_turns < 0:
            raise ValueError(f"RolloutConfig.max_user_turns must be >= 0, got {self.max_user_turns}")
        for name in ("tool_timeout_s", "tool_reward_timeout_s", "interaction_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RolloutConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"RolloutConfig.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RolloutConfig.top_p must be in (0, 1], got {self.top_p}")
        from rollout.parsers import get_parser
        from rollout.reasoning import get_reasoning_format

        get_parser(self.tool_parser)  # an unknown name fails here, not in every request
        get_reasoning_format(self.reasoning_parser)


@dataclass
class JudgeConfig:
    """An LLM judge (``rollout/users/judge.py``) for the ``judge`` reward: a server's OpenAI-compatible URL."""

    url: str | None = None
    """OpenAI-compatible URL of the judge model (``.../v1`` or its ``/chat/completions``); the
    ``judge`` reward needs it. ``rallyrl serve`` or any OpenAI-compatible server will do."""

    max_concurrency: int = 16
    """Most judge calls in flight at once; the others wait in a queue."""
    mode: Literal["score", "yes_no"] = "score"
    """``score``: the reply says "score: X" (X in 0..score_max); ``yes_no``: it says YES or NO."""
    template: str | None = None
    """Prompt with {question}, {reference}, {answer} (and {score_max}); None: the mode's default."""
    score_max: float = 10.0
    """The top of the judge's score scale; a score is divided by it (a "7/10" reply by its own 10)."""
    max_new_tokens: int = 256
    """Most tokens of a judge's reply."""
    temperature: float = 0.0
    """Sampling temperature of the judge (0: greedy)."""
    timeout_s: float = 120.0
    """Wall-clock limit of one judge call."""
    max_retries: int = 3
    """Retries of a failed call (engine or HTTP error, unparsable reply) before the judgment fails."""
    backoff_s: float = 0.5
    """First retry delay; doubles each retry, with jitter."""
    backoff_max_s: float = 8.0
    """Longest retry delay."""
    max_answer_chars: int = 4000
    """Longer questions, references and answers keep their head and tail in the prompt."""
    cache_path: str | None = None
    """JSON file of cached scores, read at start and written on exit (None: in memory only)."""
    model: str = "default"
    """The ``model`` field of OpenAI requests (servers that host several models pick by it)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` to an OpenAI-compatible URL."""
    connect_timeout_s: float = 10.0
    """Limit on opening a connection to an OpenAI-compatible URL."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_concurrency < 1:
            raise ValueError(f"JudgeConfig.max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"JudgeConfig.max_retries must be >= 0, got {self.max_retries}")
        for name in ("score_max", "timeout_s", "max_new_tokens", "max_answer_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"JudgeConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.template is not None and "{answer}" not in self.template:
            raise ValueError("JudgeConfig.template must contain {answer} (and usually {question} and {reference})")


@dataclass
class FaultConfig:
    """Faults injected into ``/generate`` (the shares are of calls; each call meets at most one)."""

    error_rate: float = 0.0
    """Share of /generate calls answered HTTP 500 without generating."""
    hang_rate: float = 0.0
    """Share of /generate calls held open without an answer for ``hang_s`` (until the client gives up)."""
    drop_rate: float = 0.0
    """Share of /generate calls whose connection is reset mid-response (headers and half the body sent)."""
    hang_s: float = 3600.0
    """How long a hung call is held open before it is served after all."""
    seed: int = 0
    """Seed of the draws: the n-th /generate call meets the same fault in every run with this seed."""

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("error_rate", "hang_rate", "drop_rate"):
            rate = getattr(self, name)
            if not 0 <= rate <= 1:
                raise ValueError(f"FaultConfig.{name} must be a share in [0, 1], got {rate}")
        if self.total_rate > 1 + 1e-9:
            raise ValueError(f"FaultConfig: error_rate + hang_rate + drop_rate must be <= 1, got {self.total_rate:g}")
        if not self.hang_s > 0:
            raise ValueError(f"FaultConfig.hang_s must be > 0, got {self.hang_s}")

    @property
    def total_rate(self) -> float:
        return self.error_rate + self.hang_rate + self.drop_rate


@dataclass
class CommonConfig:
    """Fields every command's root config has."""

    model: str | None = None
    """Hugging Face model directory (or a training checkpoint, ``out/checkpoints/step-N``); None:
    the embedded tiny-calc model. With ``engine.urls``, the tokenizer of the served model."""
    seed: int = 0
    """Seed of prompts and sampling."""
    threads: int | None = None
    """torch intra-op threads (``torch.set_num_threads``); None: torch's default (one per core,
    or ``OMP_NUM_THREADS``)."""
    progress: bool = True
    """Show progress bars."""
    event_loop: EventLoop = "auto"
    """The event loop the command runs on: ``auto`` (uvloop where installed, ``pip install
    'rallyrl[uvloop]'``, else asyncio's), ``asyncio`` or ``uvloop`` (``rollout/event_loop.py``)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        resolve_event_loop(self.event_loop)


@dataclass
class PromptsConfig(CommonConfig):
    """Where a command's prompts come from, and the tools and rewards they are rolled out with."""

    task: str | None = None
    """Synthetic task to generate prompts for (``data/synthetic.py``); None with no ``data``: calc."""
    data: str | None = None
    """Dataset file (.jsonl, .json or .parquet; rallyrl or verl layout) instead of a task."""
    num_prompts: int | None = None
    """Prompts to use: the first N records of ``data``, or N generated ones (None: all of ``data``,
    or the command's own number for a task)."""
    samples_per_prompt: int = 1
    """Samples per prompt (GRPO's group size; ``-n`` on the command line)."""
    tools: str | None = None
    """Tool config (YAML or JSON: ``class_name``, ``config``, ``schema``); None: the calculator."""
    interactions: str | None = None
    """Interaction config (verl's ``interaction_config``: ``interaction: [{name, class_name, config}]``):
    the user's turns of records whose ``interaction_kwargs`` name one. None: records' interaction_kwargs
    are ignored (single-agent conversations)."""
    agent: str | None = None
    """Agent entry point, ``module:function`` (or ``path/to/file.py:function``): an async function
    ``agent(base_url, record)`` that talks to an OpenAI-compatible ``base_url`` with its own tools and
    control flow. Each run is recorded by the agent gateway as one trajectory (``gateway``); the
    function may return the reward (else it is posted, or the reward function computes it). None:
    rallyrl's own loop drives each conversation."""
    reward: str | None = None
    """Reward by data_source, e.g. "openai/gsm8k=math+0.1*format,default=math" (``data/reward_fns.py``);
    None: the graded answer where the record has a ground truth, else the sum of the tools' rewards.
    ``judge`` in it needs ``judge.url``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task is not None and self.data is not None:
            raise ValueError("give task or data, not both")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.agent is not None and (self.tools is not None or self.interactions is not None):
            raise ValueError("agent: the agent brings its own tools and plays its own user turns; "
                             "leave tools and interactions unset")  # fmt: skip

    def check_judge(self, judge: JudgeConfig) -> None:
        """The reward and the judge agree: a ``judge`` reward has a URL, a URL has a reward using it."""
        uses_judge = self.reward is not None and "judge" in self.reward
        if uses_judge and not judge.url:
            raise ValueError("the reward uses 'judge', so judge.url must name the judge's OpenAI-compatible URL")
        if judge.url and not uses_judge:
            raise ValueError("judge.url is set but the reward does not use it: e.g. reward: judge, or 'math+0.5*judge'")


@dataclass
class RolloutJobConfig(PromptsConfig):
    """``rallyrl rollout``: records x samples through the engine, trajectories to JSONL as they finish."""

    out: str = "rollouts.jsonl"
    """Output JSONL, one trajectory per line, in finishing order."""
    resume: bool = False
    """Keep the trajectories already in ``out`` and run only the missing (prompt, sample) pairs."""
    fail_at_error_rate: float = 1.0
    """The command exits 1, naming the first error, when this share of the trajectories it ran ended
    in an error (1.0: all of them); they are all in ``out`` either way."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The agent gateway, used when ``agent`` is set."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_judge(self.judge)
        if not 0 < self.fail_at_error_rate <= 1:
            raise ValueError(f"fail_at_error_rate must be a share in (0, 1], got {self.fail_at_error_rate}")


@dataclass
class ServeConfig(CommonConfig):
    """``rallyrl serve``: the embedded engine behind SGLang's HTTP API (and OpenAI's)."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless you mean to expose the server."""
    port: int = 30000
    """Port (0: pick a free one and print it)."""
    served_model_name: str | None = None
    """Model name in the OpenAI API (default: the model directory's name)."""
    tool_parser: str = "qwen25"
    """Parser of tool calls in /v1/chat/completions (``RolloutConfig.tool_parser``'s names)."""
    reasoning_parser: str = "none"
    """Splits /v1/chat/completions answers into ``reasoning_content`` and ``content``
    (``RolloutConfig.reasoning_parser``'s names)."""
    api_key: str | None = None
    """Require ``Authorization: Bearer <key>`` on every request but the health probes (an empty key is refused)."""
    weights_dirs: list[str] = field(default_factory=lambda: ["runs"])
    """Directories ``/update_weights_from_disk`` may load from (with everything under them), besides the
    served model's own; relative ones are taken from the directory the server starts in. The default
    holds ``rallyrl train``'s ``runs/grpo/weights``; a run with another ``out`` adds its ``weights``."""
    weight_load_timeout_s: float = 300.0
    """Deadline of reading the weights of one ``/update_weights_from_disk``."""
    weight_peers: list[str] = field(default_factory=list)
    """Addresses (IPs, or CIDR networks such as 10.0.0.0/24) of trainers that may push weights by
    broadcast (``/init_weights_update_group``'s ``master_address``) to a server bound outside loopback;
    loopback trainers always may. A server bound to loopback takes loopback trainers only."""
    limits: ServeLimits = field(default_factory=ServeLimits)
    """Bounds on one request (``rollout/limits.py``), checked before anything is queued."""
    engine: LocalEngineConfig = field(default_factory=LocalEngineConfig)
    """The embedded engine behind the server."""
    faults: FaultConfig | None = None
    """Faults to inject into /generate, for testing clients (``rollout/serve/faults.py``); None: none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: a server started with it would answer without a key; give a "
                             "non-empty key, or none")  # fmt: skip
        if not self.weight_load_timeout_s > 0:
            raise ValueError(f"weight_load_timeout_s must be > 0, got {self.weight_load_timeout_s}")
        for peer in self.weight_peers:
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                raise ValueError(f"weight_peers: {peer!r} is not an IP address or a CIDR network (e.g. 10.0.0.5 or "
                                 "10.0.0.0/24)") from None  # fmt: skip
        from rollout.parsers import get_parser
        from rollout.reasoning import get_reasoning_format

        get_parser(self.tool_parser)
        get_reasoning_format(self.reasoning_parser)


@dataclass
class GatewayJobConfig(CommonConfig):
    """``rallyrl gateway``: the agent gateway in front of any engine; finished sessions go to ``out``."""

    out: str = "sessions.jsonl"
    """Output JSONL: one trajectory per finished session, written as each finishes."""
    reward: str | None = None
    """Reward of a session that none was posted for (``data/reward_fns.py``); None: the graded answer
    where the session was opened with a ground truth, else 0."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Per-call limits and sampling (``gateway.sampling``), the tool-call parser, the token check."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=lambda: GatewayConfig(port=8100))
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        uses_judge = self.reward is not None and "judge" in self.reward
        if uses_judge and not self.judge.url:
            raise ValueError("the reward uses 'judge', so judge.url must name the judge's OpenAI-compatible URL")

"""Records of reasoning-gym tasks (``--task reasoning_gym:SPEC``) and their grading by the dataset's
own ``score_answer``.

SPEC names one reasoning-gym dataset or a weighted mix of several (reasoning-gym's composite), each
with optional config fields as Python literals, and after a ``;`` the system prompt::

    basic_arithmetic                                   one dataset, its default config
    basic_arithmetic,chain_sum                         a mix, weight 1 each
    basic_arithmetic=2,chain_sum=1                     a weighted mix
    basic_arithmetic(min_digits=3, operators=("+", "*"))=2,leg_counting
    basic_arithmetic;prompt=calc                       the system prompt named ``calc``

The prompt is a system message stating the answer format and the dataset's question as the user
message. The system message is one of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, the one of its
examples, asking for ``<answer>`` tags; ``DeepSeekZero``, ``simple``, ``direct``, ``chain_of_draft``)
or of ours (``boxed``; ``calc``, the calc task's, which the embedded model learned). The
answer is read as reasoning-gym's examples read it, the last ``<answer>...</answer>`` (its
``extract_answer``), or else the last ``\\boxed{}``, and graded by the dataset's ``score_answer``
(0 to 1, partial credit where the dataset gives it); an answer counts as right at 1.0.

Seeds: record ``i`` of ``--seed S`` is item ``i`` of the dataset created with seed
``S * SEED_SPACING``. reasoning-gym draws item ``i`` of seed ``s`` from ``Random(s + i)``, so seeds
``S`` and ``S + 1`` taken as they are would share all but one item; spaced, two rallyrl seeds share
none unless ``num`` exceeds ``SEED_SPACING``. A record keeps what re-creates its item
(``extra["reasoning_gym"]``: dataset, config, seed, size, index) and grading re-creates it, so metadata
that JSON cannot hold exactly (tuples, int keys, nested dataclasses) is never needed from the file;
the metadata is kept as JSON text for readers, and re-creating an item that differs from it (another
reasoning-gym version) is an error, not a wrong grade.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any

import orjson

from data.rewards import extract_boxed
from data.schema import Record

EXTRA = "reasoning-gym"
"""The pip extra that installs reasoning-gym."""
REWARD = "reasoning_gym"
"""The reward (``data/reward_fns.py``) that grades these records: named by each in ``extra["answer_reward"]``."""
DATA_SOURCE_PREFIX = "reasoning_gym/"
SEED_SPACING = 1_000_000
"""Record ``i`` of rallyrl seed ``S`` is reasoning-gym item ``i`` of seed ``S * SEED_SPACING``."""
BOXED_PROMPT = "Give the final answer as \\boxed{answer}, with only the answer inside."
CALC_PROMPT = "Use the calculator tool for arithmetic. Give the final answer as \\boxed{N}."
"""The calc task's system prompt (``data/synthetic.py``, which imports this module): the embedded model learned it."""
EXTRA_PROMPTS = {"boxed": BOXED_PROMPT, "calc": CALC_PROMPT}
"""Prompts of ours beside reasoning-gym's ``SYSTEM_PROMPTS``."""
DEFAULT_PROMPT = "default"
_OPENERS, _CLOSERS = "([{", ")]}"


class MissingExtraError(ImportError, ValueError):
    """reasoning-gym is not installed; the message names the pip command (a ValueError too, so the
    commands show it as one line)."""


def require_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or a MissingExtraError that says ``pip install 'rallyrl[reasoning-gym]'``."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "reasoning_gym":
            raise  # the package is there but one of its own imports failed: show that
        raise MissingExtraError(
            f"the {EXTRA} tasks need the package 'reasoning_gym', which is not installed: "
            f"pip install 'rallyrl[{EXTRA}]'"
        ) from None


@dataclass(frozen=True)
class DatasetChoice:
    """One dataset of a spec: its name, weight in the mix and config fields."""

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """A parsed SPEC: the datasets and the name of the system prompt."""

    datasets: tuple[DatasetChoice, ...]
    prompt: str = DEFAULT_PROMPT


def parse_spec(spec: str) -> TaskSpec:
    """``"basic_arithmetic(min_digits=3)=2,chain_sum;prompt=calc"`` as a TaskSpec; a ValueError says
    what is wrong (an unknown dataset names close ones, a bad config field lists the dataset's fields)."""
    where = f"reasoning_gym:{spec}"
    mix, *options = _split_top(spec, ";", where)
    prompt = DEFAULT_PROMPT
    for option in options:
        key, sep, value = option.partition("=")
        if key.strip() != "prompt" or not sep:
            raise ValueError(f"{where}: unknown option {option.strip()!r}; the only option is prompt=NAME")
        prompt = value.strip()
    known_prompts = sorted({*require_reasoning_gym().utils.SYSTEM_PROMPTS, *EXTRA_PROMPTS})
    if prompt not in known_prompts:
        raise ValueError(f"{where}: unknown prompt {prompt!r}; known: {', '.join(known_prompts)}")
    if not mix.strip():
        raise ValueError(f"{where}: name a reasoning-gym dataset, e.g. reasoning_gym:basic_arithmetic")
    datasets = tuple(_parse_choice(entry, where) for entry in _split_top(mix, ",", where))
    names = [choice.name for choice in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: a dataset is named twice; give each once, with its weight")
    return TaskSpec(datasets, prompt)


def system_prompt(name: str) -> str:
    """The system prompt called ``name``: one of reasoning-gym's ``SYSTEM_PROMPTS`` or of EXTRA_PROMPTS."""
    if name in EXTRA_PROMPTS:
        return EXTRA_PROMPTS[name]
    return require_reasoning_gym().utils.SYSTEM_PROMPTS[name].strip()


def make_reasoning_gym_records(spec: str, num: int, seed: int = 0) -> list[Record]:
    """``num`` records of the reasoning-gym SPEC (see the module docstring), seeded by ``seed``."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    task = parse_spec(spec)
    if num == 0:
        return []
    rg = require_reasoning_gym()
    rg_seed = seed * SEED_SPACING
    if len(task.datasets) == 1:
        only = task.datasets[0]
        dataset = _create(only.name, only.config, rg_seed, num)
        parts = {only.name: dataset}
        draw = dataset.__getitem__
    else:  # reasoning-gym's own weighted mix; each part gets seed rg_seed + its position + 1
        from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

        specs = [DatasetSpec(choice.name, choice.weight, dict(choice.config)) for choice in task.datasets]
        try:
            composite = CompositeDataset(CompositeConfig(size=num, seed=rg_seed, datasets=specs))
        except Exception:
            for choice in task.datasets:
                _create(choice.name, choice.config, rg_seed, num)  # the error that names the dataset and its fields
            raise
        parts, draw = composite.datasets, composite.__getitem__
    version = rg_version(rg)
    prompt = system_prompt(task.prompt)
    configs = {choice.name: choice.config for choice in task.datasets}
    for name, dataset in parts.items():  # grading in this process finds them made
        _remember(name, configs[name], dataset)
    records = []
    for index in range(num):
        entry = draw(index)
        name = entry["metadata"].get("source_dataset", task.datasets[0].name)
        source = {
            "dataset": name,
            "config": _json_text(configs[name]),
            "seed": parts[name].seed,
            "size": parts[name].size,
            "index": index,
            "metadata": _json_text(entry["metadata"]),
            "version": version,
        }
        answer = entry.get("answer")
        records.append(
            Record(
                prompt=[{"role": "system", "content": prompt}, {"role": "user", "content": entry["question"]}],
                data_source=DATA_SOURCE_PREFIX + name,
                ground_truth=None if answer is None else str(answer),
                extra={"answer_reward": REWARD, "reasoning_gym": source},
                index=index,
            )
        )
    return records


def extract_answer(text: str) -> str | None:
    """The answer of a completion: the last ``<answer>...</answer>`` (reasoning-gym's ``extract_answer``),
    else the last ``\\boxed{}``, else None."""
    answer = require_reasoning_gym().utils.extract_answer(text)
    return answer if answer is not None else extract_boxed(text)


def score_completion(source: Any, completion: str) -> float:
    """The dataset's ``score_answer`` of the completion's answer, for the item ``source`` (a record's
    ``extra["reasoning_gym"]``) re-creates. No answer scores 0, as does one the dataset's scorer
    cannot read (some raise on malformed answers)."""
    dataset, entry = recreate_entry(source)
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    try:
        score = float(dataset.score_answer(answer, entry))
    except Exception:  # a malformed answer, e.g. prime_factorization's int("abc"): it is wrong
        return 0.0
    return min(max(score, 0.0), 1.0)


def recreate_entry(source: Any) -> tuple[Any, dict[str, Any]]:
    """The dataset and the item that a record's ``extra["reasoning_gym"]`` names, re-created; a
    ValueError when the record does not hold one, or when the re-created item is another than the
    record's (its metadata differs: written by another reasoning-gym version)."""
    if not isinstance(source, dict):
        raise ValueError('not a reasoning-gym record: its extra has no "reasoning_gym" mapping')
    try:
        name, config, seed, size, index = (source[k] for k in ("dataset", "config", "seed", "size", "index"))
        config = orjson.loads(config) if isinstance(config, str) else config
    except (KeyError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"extra.reasoning_gym: {exc} (it needs dataset, config, seed, size and index)") from None
    dataset = _scoring_dataset(str(name), _json_text(config), int(seed), int(size))
    entry = _entry(dataset, int(index))
    stored = source.get("metadata")
    if stored is not None and orjson.loads(stored) != orjson.loads(_json_text(entry["metadata"])):
        raise ValueError(
            f"reasoning-gym {rg_version(require_reasoning_gym())} re-creates item {index} of {name} (seed {seed}) "
            f"otherwise than the record holds (written with reasoning-gym {source.get('version', '?')}): "
            "write the records again with this version"
        )
    return dataset, entry


def rg_version(rg: Any) -> str:
    """The installed reasoning-gym's version (its distribution's, which its ``__version__`` lags)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reasoning_gym")
    except PackageNotFoundError:
        return str(getattr(rg, "__version__", "unknown"))


_DATASETS: dict[tuple[str, str, int, int], Any] = {}
"""Datasets by (name, config, seed, size), made once: some take a while (arc_agi reads its files)."""
MAX_DATASETS = 64


def _scoring_dataset(name: str, config_text: str, seed: int, size: int) -> Any:
    """The dataset a record names, from _DATASETS or created (and kept)."""
    key = (name, config_text, seed, size)
    if key not in _DATASETS:
        _remember(name, orjson.loads(config_text), _create(name, orjson.loads(config_text), seed, size))
    return _DATASETS[key]


def _remember(name: str, config: dict[str, Any], dataset: Any) -> None:
    if len(_DATASETS) >= MAX_DATASETS:
        _DATASETS.clear()
    _DATASETS[(name, _json_text(config), int(dataset.seed), int(dataset.size))] = dataset


@functools.lru_cache(maxsize=4096)
def _entry(dataset: Any, index: int) -> dict[str, Any]:
    return dataset[index]


def _create(name: str, config: dict[str, Any], seed: int, size: int) -> Any:
    """``reasoning_gym.create_dataset`` with errors that name the dataset and its config fields."""
    rg = require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"e.g. {', '.join(sorted(DATASETS)[:5])}"
        raise ValueError(f"unknown reasoning-gym dataset {name!r}; {hint} ({len(DATASETS)} datasets in all)")
    try:
        return rg.create_dataset(name, **config, seed=seed, size=size)
    except (TypeError, AssertionError, ValueError) as exc:
        fields = [f for f in DATASETS[name][1].__dataclass_fields__ if f not in ("seed", "size")]
        raise ValueError(f"reasoning-gym dataset {name} with config {config}: {exc or type(exc).__name__} "
                         f"(its config fields: {', '.join(fields)})") from None  # fmt: skip


def _parse_choice(entry: str, where: str) -> DatasetChoice:
    """``name``, ``name=2`` or ``name(key=value, ...)=2``."""
    text = entry.strip()
    weight = 1.0
    head, sep, tail = text.rpartition("=")
    if sep and _depth_ok(head):
        try:
            weight = float(tail)
        except ValueError:
            raise ValueError(f"{where}: weight of {head.strip()!r} is {tail.strip()!r}, not a number") from None
        if not weight > 0:
            raise ValueError(f"{where}: weight of {head.strip()!r} must be positive, got {tail.strip()}")
        text = head.strip()
    name, paren, args = text.partition("(")
    name = name.strip()
    if not name.isidentifier():
        raise ValueError(f"{where}: {entry.strip()!r} is not a dataset name (write name, name=2 or name(key=value))")
    config: dict[str, Any] = {}
    if paren:
        if not args.rstrip().endswith(")"):
            raise ValueError(f"{where}: the config of {name} does not end with ')'")
        config = _parse_config(name, args.rstrip()[:-1], where)
    return DatasetChoice(name, weight, config)


def _parse_config(name: str, args: str, where: str) -> dict[str, Any]:
    """``min_digits=3, operators=("+", "*")`` -> a JSON-safe mapping (tuples become lists)."""
    try:
        call = ast.parse(f"_({args})", mode="eval").body
    except SyntaxError:
        raise ValueError(f"{where}: cannot read the config of {name}: ({args})") from None
    if not isinstance(call, ast.Call) or call.args or any(keyword.arg is None for keyword in call.keywords):
        raise ValueError(f"{where}: the config of {name} must be key=value pairs")
    config: dict[str, Any] = {}
    for keyword in call.keywords:
        if keyword.arg in ("seed", "size"):
            raise ValueError(f"{where}: {name}({keyword.arg}=...): seed and size come from the task's seed and num")
        try:
            config[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            raise ValueError(
                f"{where}: {name}({keyword.arg}=...): the value must be a literal (number, string, list, ...)"
            ) from None
    try:
        return orjson.loads(orjson.dumps(config))
    except TypeError as exc:
        raise ValueError(f"{where}: the config of {name} must be JSON-like: {exc}") from None


def _split_top(text: str, separator: str, where: str) -> list[str]:
    """``text`` split at ``separator`` outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, char in enumerate(text):
        if quote:
            quote = "" if char == quote and text[i - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth -= 1
            if depth < 0:
                raise ValueError(f"{where}: unbalanced {char!r}")
        elif char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise ValueError(f"{where}: unclosed {'quote' if quote else 'bracket'}")
    return [*parts, text[start:]]


def _depth_ok(text: str) -> bool:
    """Whether every bracket in ``text`` is closed (the ``=`` after it is a weight, not a config's)."""
    return sum(text.count(c) for c in _OPENERS) == sum(text.count(c) for c in _CLOSERS)


def _json_text(value: Any) -> str:
    """Compact JSON text; int keys as strings, anything else JSON cannot hold as its ``str``."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS, default=str).decode()

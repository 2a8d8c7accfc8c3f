"""The Python API: typed config objects and a trainer built from a model, a dataset and reward functions.

The shape is TRL's (``GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
train_dataset=...)``), the keys are veRL's: :data:`RLConfig` *is* the schema the YAML files and the
CLI's dotted overrides fill (:class:`tearless.config.schema.Config`), so
``RLConfig(data=DataConfig(train_batch_size=8))`` and ``data.train_batch_size=8`` are the same
setting. ``tearless train`` builds a :class:`Trainer` from the command line's config and calls
:meth:`Trainer.train`, so the CLI and this API run the same code.

Objects that are not files (a ``PreTrainedModel``, a list of rows, a ``datasets.Dataset``) are
written once to the cache (``$TEARLESS_CACHE``, by default ``~/.cache/tearless``) under a name made
from a hash of their contents: the workers load files (in other processes too, with Ray), and the
same model and data give the same run directory, so a second ``train()`` resumes the first.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tearless.api_names import API_NAMES
from tearless.config import load_config

# F401 is silenced below: the config classes are re-exported through ``__all__ = list(API_NAMES)``,
# which ruff cannot read
from tearless.config.dpo import DPOConfig  # noqa: F401
from tearless.config.rm import RMConfig  # noqa: F401
from tearless.config.schema import (
    ActorConfig,  # noqa: F401
    ActorRolloutRefConfig,  # noqa: F401
    AlgorithmConfig,  # noqa: F401
    Config,
    CriticConfig,  # noqa: F401
    DataConfig,  # noqa: F401
    ModelConfig,  # noqa: F401
    OptimConfig,  # noqa: F401
    RewardModelConfig,  # noqa: F401
    RolloutConfig,  # noqa: F401
    TrainerConfig,  # noqa: F401
)
from tearless.config.sft import SFTConfig  # noqa: F401

# local imports: torch: building a config through the API does not import it; training does

RLConfig = Config
"""The RL trainer's config: the same nested fields as the YAML files (``RLConfig().data.train_batch_size``
is ``data.train_batch_size``); :class:`tearless.config.schema.Config` under the name TRL users expect."""

RewardFunc = Callable[..., Any]
"""veRL's reward contract: ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``
returning a float or a dict with a ``score`` key (its other keys are logged as reward components)."""

MetricCallback = Callable[[int, dict], None]
"""``callback(step, metrics)``: called after each step's metrics are logged (step 0: the validation
before training), with the same metric names as ``metrics.jsonl``."""


class SummedReward:
    """Several reward functions as one: the score is :math:`r = \\sum_i w_i\\, r_i`.

    Each function's own score is reported under its name (``reward_extra/<name>/mean`` in the metrics), so the
    parts of a composite reward stay visible. ``custom_reward_function.reward_kwargs`` reach each
    function that names them (or takes ``**kwargs``). A class rather than a closure so that it pickles for Ray
    workers when its functions do.
    """

    def __init__(self, funcs: Sequence[RewardFunc], weights: Sequence[float] | None = None) -> None:
        if not funcs:
            raise ValueError("reward_funcs is empty; give at least one reward function")
        weights = [1.0] * len(funcs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
        self.funcs, self.weights = list(funcs), weights
        names = [getattr(f, "__name__", type(f).__name__) for f in self.funcs]
        # Two functions of one name (two lambdas) get their position appended.
        self.names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]

    def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict | None = None,
        **kw: Any,
    ) -> dict[str, float]:
        parts = {}
        for name, fn in zip(self.names, self.funcs, strict=True):
            takes = _keywords(fn)
            mine = kw if takes is None else {k: v for k, v in kw.items() if k in takes}
            value = fn(data_source, solution_str, ground_truth, extra_info, **mine)
            parts[name] = float(value["score"] if isinstance(value, Mapping) else value)
        return {"score": sum(w * parts[n] for w, n in zip(self.weights, self.names, strict=True)), **parts}


def _keywords(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword names ``fn`` accepts; None when it takes ``**kwargs`` (or has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class Trainer:
    """RL training from Python objects: ``Trainer(model, reward_funcs, args, train_dataset).train()``.

    - ``model``: a local Hugging Face model directory, a ``transformers.PreTrainedModel`` (give its
      tokenizer as ``processing_class`` unless ``model.name_or_path`` is a directory holding one), or
      ``None`` for ``args.actor_rollout_ref.model.path`` (``None`` there too: the embedded tiny model).
    - ``reward_funcs``: a function with veRL's reward contract (:data:`RewardFunc`), a list of them
      (summed, weighted by ``reward_weights``: :class:`SummedReward`), or ``None`` for
      ``custom_reward_function.path`` or the built-in scorers chosen by each row's ``data_source``.
    - ``args``: an :data:`RLConfig` (or a nested dict, or a YAML path); ``overrides`` are dotted
      ``key=value`` strings applied after it and ``preset`` an algorithm preset merged before it, as on
      the command line.
    - ``train_dataset`` / ``eval_dataset``: a data file path (or a list of paths), a list of rows, or a
      ``datasets.Dataset``. A row needs a ``prompt`` (chat messages, or a string); ``data_source``
      defaults to ``"custom"``, a ``ground_truth`` column becomes ``reward_model.ground_truth``, and
      the row's other columns reach the reward function in ``extra_info``, as TRL passes them.
      ``None``: the config's ``data.*_files`` (or the embedded task's). No ``eval_dataset`` with a
      ``train_dataset`` validates on the training rows.
    - ``callbacks``: :data:`MetricCallback` functions called with each step's metrics.

    ``train()`` shows a progress bar (``tqdm.auto``: a widget in Jupyter, text in a terminal) when
    ``trainer.logger`` has ``console``, and returns the summary: ``run_dir``, the held-out metrics
    ``before`` and ``after`` training, ``steps``, ``seconds`` and the last ``checkpoint``.
    """

    def __init__(
        self,
        model: Any = None,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Iterable[MetricCallback] = (),
        *,
        reward_weights: Sequence[float] | None = None,
        overrides: Iterable[str] = (),
        preset: str | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.model, self.processing_class = model, processing_class
        self.args = copy.deepcopy(args) if isinstance(args, Config) else args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.callbacks: list[MetricCallback] = list(callbacks)
        self.overrides, self.preset, self.log = list(overrides), preset, log
        if reward_funcs is None or callable(reward_funcs):
            if reward_weights is not None and reward_funcs is None:
                raise ValueError("reward_weights needs reward_funcs")
            self.reward_fn = (
                SummedReward([reward_funcs], reward_weights)
                if reward_funcs is not None and reward_weights is not None
                else reward_funcs
            )
        else:
            self.reward_fn = SummedReward(list(reward_funcs), reward_weights)
        self.config: Config | None = None

    def add_callback(self, callback: MetricCallback) -> None:
        """Call ``callback(step, metrics)`` after each logged step, as ``callbacks=[...]`` does."""
        self.callbacks.append(callback)

    def resolved_config(self) -> Config:
        """The validated config this trainer runs: ``args`` with the model and datasets filled in
        (writing objects that are not files to the cache first), ``overrides`` applied.

        Built on the first call and kept (``train()`` runs this one), so a config error surfaces here
        before anything loads, and the CLI prints the config ``train`` would run."""
        if self.config is None:
            self.config = self._load_config()
        return self.config

    def _load_config(self) -> Config:

        paths = []
        model_path = self._model_path()
        if model_path is not None:
            paths.append(f"actor_rollout_ref.model.path={model_path}")
        if self.train_dataset is not None:
            train = _data_files(self.train_dataset, "train", have_reward_fn=self.reward_fn is not None)
            val = (
                train
                if self.eval_dataset is None
                else _data_files(self.eval_dataset, "val", have_reward_fn=self.reward_fn is not None)
            )
            paths += [f"data.train_files={_override_value(train)}", f"data.val_files={_override_value(val)}"]
        elif self.eval_dataset is not None:
            val = _data_files(self.eval_dataset, "val", have_reward_fn=self.reward_fn is not None)
            paths.append(f"data.val_files={_override_value(val)}")
        # The objects given here come before the caller's own overrides, which win as on the CLI.
        return load_config(self.args, [*paths, *self.overrides], preset=self.preset)

    def train(self) -> dict[str, Any]:
        """Run the training (validation before and after, checkpoints, loggers) and return its summary."""
        from tearless.trainers.rl import RLTrainer

        trainer = RLTrainer(
            self.resolved_config(), reward_fn=self.reward_fn, log=self.log, callbacks=self.callbacks
        )
        return trainer.fit()

    def _model_path(self) -> str | None:
        if self.model is None:
            if self.processing_class is not None:
                raise ValueError("processing_class without a model: pass the model it belongs to")
            return None
        if isinstance(self.model, (str, os.PathLike)):
            if self.processing_class is not None:
                raise ValueError(
                    "processing_class with a model path: the tokenizer is loaded from the model "
                    "directory (or set actor_rollout_ref.model.tokenizer_path)"
                )
            return str(self.model)
        return _save_model(self.model, self.processing_class)


def _override_value(files: str | list[str]) -> str:
    return files if isinstance(files, str) else "[" + ",".join(files) + "]"


def _cache_root() -> Path:
    from tearless.cachedir import default_cache_dir

    return default_cache_dir() / "python-api"


def _save_model(model: Any, tokenizer: Any) -> str:
    """Write a ``PreTrainedModel`` (and its tokenizer) to the cache, named by a hash of its config,
    weights and tokenizer, and return the directory."""
    import torch

    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"model must be a model directory or a transformers PreTrainedModel, not {type(model).__name__}"
        )
    if hasattr(model, "peft_config"):
        raise ValueError(
            "model is a peft model, whose save_pretrained writes only its adapter: pass "
            "model.merge_and_unload(), or the base model with actor_rollout_ref.model.lora_rank set"
        )
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or ""
        if not (source and Path(source).is_dir()):
            raise ValueError(
                "a PreTrainedModel needs its tokenizer: pass processing_class=tokenizer (the model's "
                f"name_or_path {source!r} is not a directory to load one from)"
            )
        from tearless.models.loading import load_tokenizer

        tokenizer = load_tokenizer(source, key="model.name_or_path")
    digest = hashlib.sha256(model.config.to_json_string().encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    name = Path(getattr(model, "name_or_path", "") or model.config.model_type).name or "model"
    final = _cache_root() / "models" / f"{name}-{digest.hexdigest()[:12]}"
    if not (final / "config.json").is_file():
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, final)
        except OSError:  # another process wrote the same model first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _data_files(dataset: Any, split: str, *, have_reward_fn: bool) -> str | list[str]:
    """A data file path (or list) as given; rows (a list, or a ``datasets.Dataset``) written to the
    cache as JSON lines named by their hash."""
    if isinstance(dataset, (str, os.PathLike)):
        return str(dataset)
    if isinstance(dataset, Sequence) and dataset and all(isinstance(d, (str, os.PathLike)) for d in dataset):
        return [str(d) for d in dataset]
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # datasets.Dataset
        dataset = dataset.to_list()
    if not isinstance(dataset, Sequence) or isinstance(dataset, (str, bytes)):
        raise TypeError(
            f"{split} dataset must be a file path, a list of paths, a list of row dicts or a "
            f"datasets.Dataset, not {type(dataset).__name__}"
        )
    if not dataset:
        raise ValueError(f"the {split} dataset has no rows")
    rows = [_verl_row(row, i, split, have_reward_fn=have_reward_fn) for i, row in enumerate(dataset)]
    from tearless.data.rows import write_jsonl

    text = json.dumps(rows, sort_keys=True, default=str)
    path = _cache_root() / "data" / f"{split}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(rows, path)
    return str(path)


_ROW_KEYS = ("data_source", "prompt", "reward_model", "ability", "extra_info", "ground_truth")


def _verl_row(row: Any, index: int, split: str, *, have_reward_fn: bool) -> dict:
    """One row in veRL's schema: ``data_source`` defaults to ``custom`` (with reward functions), a
    ``ground_truth`` column moves into ``reward_model``, other columns into ``extra_info``."""
    if not isinstance(row, Mapping):
        raise TypeError(f"{split} dataset row {index}: expected a dict of columns, got {type(row).__name__}")
    row = dict(row)
    if "prompt" not in row:
        raise ValueError(f"{split} dataset row {index}: no 'prompt' column (columns: {sorted(row)})")
    if "data_source" not in row:
        if not have_reward_fn:
            raise ValueError(
                f"{split} dataset row {index}: no 'data_source' column, which picks the built-in scorer; "
                "add one (e.g. 'gsm8k') or pass reward_funcs"
            )
        row["data_source"] = "custom"
    if "reward_model" not in row:
        if "ground_truth" not in row:
            raise ValueError(
                f"{split} dataset row {index}: no 'ground_truth' (or 'reward_model': "
                f"{{'ground_truth': ...}}) column (columns: {sorted(row)})"
            )
        row["reward_model"] = {"style": "rule", "ground_truth": row.pop("ground_truth")}
    extra = {k: row.pop(k) for k in [k for k in row if k not in _ROW_KEYS]}
    if extra:
        row["extra_info"] = {**extra, **(row.get("extra_info") or {})}
    return row


__all__ = list(API_NAMES)

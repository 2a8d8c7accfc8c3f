"""What the RL trainer reads before its first step, in this order: the run's files (the config's, or
the embedded task's, Hub IDs resolved to their snapshots once), their fingerprints, the tokenizer
(checked against every model that reads its ids), the prompt sets, and the checkpoint to resume from.
The facts derived from the config are the plan's (:mod:`tearless.config.plan`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tearless.config import Config, resume_compat
from tearless.config.identity import fingerprint_changes, fingerprints
from tearless.config.plan import RunFiles, adapter_path, critic_path
from tearless.config.validate_vision import validate_vision
from tearless.data import PromptDataset, PromptLoader, load_many
from tearless.data.prompts import check_same_tokenizer, check_vocabulary
from tearless.models.loading import check_model_dir, load_tokenizer
from tearless.models.vision import load_processor, vision_model_type
from tearless.rewards.registry import UnknownDataSource, check_data_sources, get_scorer
from tearless.run import checkpoint as ckpt
from tearless.tasks.bootstrap import TaskSpec
from tearless.trainers.warmup import prepare_task

TEACHER_KEY = "actor_rollout_ref.teacher.model.path"


def resolve_files(cfg: Config, log: Callable[[str], None]) -> RunFiles:
    """Model, training and validation data, and tool YAML: the config's, or the embedded task's (made
    by :func:`~tearless.trainers.warmup.prepare_task` when the config names no model or no data); the
    teacher's weights, the LoRA adapter and the critic's weights the config names. Every Hub ID becomes
    its cached snapshot here, once, so every rank and engine reads one directory."""
    model_path, train_files, val_files = (
        cfg.actor_rollout_ref.model.path,
        cfg.data.train_files,
        cfg.data.val_files,
    )
    tools = None
    if model_path is not None:
        # A Hub ID becomes its cached snapshot here, once, so every rank and engine reads one directory.
        model_path = str(check_model_dir(model_path, "actor_rollout_ref.model.path"))
        if model_path != cfg.actor_rollout_ref.model.path:  # a Hub ID: known to read images only now
            validate_vision(cfg, model_path)
    if model_path is None or train_files is None:
        files = prepare_task(
            TaskSpec.from_config(cfg.task), cfg.task.cache_dir, fresh=cfg.task.fresh, log=log
        )
        model_path = model_path or files.model_dir
        tools = files.tool_config_path
        if train_files is None:
            train_files, val_files = files.train_file, files.val_file
    teacher = cfg.actor_rollout_ref.teacher.model.path
    teacher_path = str(check_model_dir(teacher, TEACHER_KEY)) if teacher else None
    return RunFiles(
        str(model_path),
        train_files,
        val_files,
        tools,
        teacher_path,
        lora_adapter_path=adapter_path(cfg),
        critic_path=critic_path(cfg),
    )


def run_fingerprints(cfg: Config, files: RunFiles) -> dict[str, Any]:
    """The files the run reads, by content (kept in checkpoints, compared on resume): a model or data
    file rewritten at the same path makes another run."""
    return fingerprints(
        {
            "actor_rollout_ref.model.path": files.model_path,
            "actor_rollout_ref.model.tokenizer_path": cfg.actor_rollout_ref.model.tokenizer_path,
            "critic.model.path": cfg.critic.model.path,
            TEACHER_KEY: files.teacher_path,
            "data.train_files": files.train_files,
        }
    )


def run_tokenizer(cfg: Config, files: RunFiles) -> Any:
    """The tokenizer (``model.tokenizer_path``, else the model's), checked to fit the policy's
    vocabulary and, when a teacher is distilled, to be the teacher's own: its log-probs are read at
    the student's token ids."""
    m = cfg.actor_rollout_ref.model
    key = "actor_rollout_ref.model." + ("tokenizer_path" if m.tokenizer_path else "path")
    tokenizer = load_tokenizer(m.tokenizer_path or files.model_path, key=key)
    check_vocabulary(tokenizer, files.model_path, key)
    if files.teacher_path:
        check_same_tokenizer(tokenizer, load_tokenizer(files.teacher_path, key=TEACHER_KEY), TEACHER_KEY)
        check_vocabulary(tokenizer, files.teacher_path, TEACHER_KEY)
    return tokenizer


def episodes_score_themselves(cfg: Config) -> bool:
    """An environment or an agent program scores its own episodes (multi-turn ``env`` or ``agent``)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return mt.enable and (mt.env is not None or mt.agent is not None)


def uses_builtin_scorers(cfg: Config, reward_fn: Callable[..., Any] | None) -> bool:
    """Whether the rows are scored by the built-in dispatcher by ``data_source``: no reward function
    given (in Python or by ``custom_reward_function.path``), a rule score in use, no agent or
    environment scoring its own episodes."""
    rm = cfg.reward_model
    rule_used = not rm.enable or rm.rule_weight != 0.0
    given = reward_fn is not None or bool(cfg.custom_reward_function.path)
    return not given and rule_used and not episodes_score_themselves(cfg)


def rule_scored_validation(
    cfg: Config, reward_fn: Callable[..., Any] | None, val_set: Any, log: Callable[[str], None]
) -> bool:
    """Whether validation scores with the rule scorers alone: the training reward is a reward model or a
    judge with ``reward_model.rule_weight=0``, and a rule can score every held-out row (a reward
    function, or a built-in scorer for each ``data_source``). Then ``val-core/*/acc`` is the task's
    scorer's, not the reward model's verdict (veRL validates with rule-based rewards only). A held-out
    source no rule scores is validated with the training reward, said in one line."""
    rm = cfg.reward_model
    if not (rm.enable or rm.judge.enable) or rm.rule_weight != 0.0 or episodes_score_themselves(cfg):
        return False
    if reward_fn is not None or cfg.custom_reward_function.path:
        return True
    unscored = []
    for source in sorted({val_set[i]["data_source"] for i in range(len(val_set))}):
        try:
            get_scorer(source)
        except UnknownDataSource:
            unscored.append(source)
    if unscored:
        log(
            f"validation: no rule scores data_source {unscored[0]!r}, so held-out rows are scored by the "
            "training reward (the reward model or judge); give custom_reward_function.path for the "
            "task's own accuracy"
        )
    return not unscored


def run_processor(files: RunFiles) -> Any:
    """The policy's processor (its image processor and tokenizer) when it is a vision-language model,
    else None."""
    return load_processor(files.model_path) if vision_model_type(files.model_path) else None


def prompt_sets(
    cfg: Config,
    files: RunFiles,
    tokenizer: Any,
    reward_fn: Callable[..., Any] | None,
    log: Callable[[str], None],
) -> tuple[PromptDataset, PromptDataset]:
    """The training and validation prompts (:func:`prompt_set` of each), rows with images read
    through the policy's processor when it is a vision-language model (:func:`run_processor`; the
    datasets' ``processor``, None for a text policy)."""
    processor = run_processor(files)
    if processor is not None and cfg.actor_rollout_ref.model.use_remove_padding:
        log(
            "actor_rollout_ref.model.use_remove_padding: the packed forward does not place image features, "
            "so this vision-language policy's log-probs take the padded pass"
        )
    return (
        prompt_set(cfg, "train", files.train_files, tokenizer, reward_fn, log, processor),
        prompt_set(cfg, "val", files.val_files, tokenizer, reward_fn, log, processor),
    )


def prompt_set(
    cfg: Config,
    which: str,
    paths: Any,
    tokenizer: Any,
    reward_fn: Callable[..., Any] | None,
    log: Callable[[str], None],
    processor: Any = None,
) -> PromptDataset:
    """The ``train`` or ``val`` prompts of ``paths`` (cut to ``data.<which>_max_samples`` when set),
    their data sources checked against the built-in scorers when those score them; one warning line
    when the set holds the tokenizer's unknown token, one note when it lost overlong prompts."""
    data = cfg.data
    key, name = f"data.{which}_files", "training" if which == "train" else "validation"
    rows = load_many(paths, key)
    limit = getattr(data, f"{which}_max_samples")
    if limit > 0:
        rows = rows[:limit]
    dataset = PromptDataset(
        rows,
        tokenizer,
        source=str(paths),
        max_prompt_length=data.max_prompt_length,
        truncation=data.truncation,
        filter_overlong_prompts=data.filter_overlong_prompts,
        chat_template=data.chat_template,
        template_kwargs=dict(data.apply_chat_template_kwargs),
        processor=processor,
        image_key=data.image_key,
    )
    if uses_builtin_scorers(cfg, reward_fn):
        check_data_sources({key: (paths, rows)})
    if dataset.num_unknown:
        log(
            f"warning: {dataset.num_unknown} of {len(dataset)} {name} prompts hold the tokenizer's "
            "unknown token: the model cannot read part of them (check the tokenizer, or the "
            "chat template's text)"
        )
    if dataset.num_filtered:
        log(
            f"data.filter_overlong_prompts: dropped {dataset.num_filtered} {name} prompts longer "
            f"than data.max_prompt_length={data.max_prompt_length} tokens; {len(dataset)} remain"
        )
    return dataset


def prompt_loader(cfg: Config, train_set: PromptDataset) -> PromptLoader:
    """The training prompts' loader. With dynamic sampling a step may draw several generation
    batches of ``data.gen_batch_size``, so the loader's position is a count of batches consumed
    (checkpointed), not the step number."""
    data = cfg.data
    gen_batch = data.gen_batch_size if cfg.algorithm.filter_groups.enable and data.gen_batch_size else None
    return PromptLoader(
        train_set,
        gen_batch or data.train_batch_size,
        shuffle=data.shuffle,
        seed=cfg.trainer.seed if data.seed is None else data.seed,
    )


def resume_point(
    cfg: Config, run_dir: Path, prints: dict[str, Any], log: Callable[[str], None]
) -> tuple[int, Path | None, dict[str, Any] | None]:
    """The step to start from, the checkpoint to resume (None: from scratch) and its state, after
    checking that the checkpoint belongs to this run (its config, :func:`resume_compat.check_resume`;
    its files' fingerprints ``prints``; its state's format). ``trainer.resume_mode=disable`` refuses a
    directory that already holds checkpoints."""
    t = cfg.trainer
    if t.resume_mode == "disable":
        old = ckpt.complete_checkpoints(run_dir)
        if old:
            # Training from scratch here would mix its checkpoints with the old run's, and resume or
            # pruning could later pick the wrong ones.
            raise FileExistsError(
                f"trainer.resume_mode=disable but {run_dir} already holds checkpoints "
                f"({old[-1].name}, …); use another trainer.experiment_name or trainer.default_local_dir, "
                "or delete them"
            )
        return 0, None, None
    from_path = t.resume_from_path if t.resume_mode == "resume_path" else None
    path = ckpt.checkpoint_to_resume(run_dir, from_path, log=log)
    if path is None:
        return 0, None, None
    state = ckpt.load_state(path)
    resume_compat.check_resume(state.get("config"), cfg, path, log=log)
    changed = fingerprint_changes(state.get("fingerprints"), prints)
    if changed:
        raise resume_compat.ResumeMismatch(
            f"cannot resume from {path}: files of the run changed since it was written "
            f"({'; '.join(changed[:5])}{'; …' if len(changed) > 5 else ''}). Put the old files back to "
            "resume, or start a new run with another trainer.experiment_name"
        )
    if "workers" not in state:
        raise ValueError(
            f"{path} was written by an older tearless whose optimizer state format this one does not "
            "read; start a new run from its actor/ weights with actor_rollout_ref.model.path and "
            "trainer.resume_mode=disable"
        )
    return int(state["global_step"]), path, state

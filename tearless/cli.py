"""``tearless <command> key=value …``: the command-line interface.

Commands: ``train`` (RL training, veRL-style dotted overrides), ``eval`` (score a model on a
dataset with the validation metrics), ``sft``, ``dpo`` and ``rm`` (the offline trainers),
``data make|prepare|inspect`` (datasets), ``model import-gguf`` (a GGUF file as a model directory),
``samples`` (read a run's rollout records), ``report`` and ``compare`` (plots and diagnoses of runs),
``config show [train|sft|dpo|rm]`` (every key with its value and documentation), ``flow-pretrain``
and ``flow-train`` (Flow-GRPO, defined in ``tearless.flow.cli``). Heavy imports happen inside the commands so
``tearless --help`` is quick.

Every refusal is one line on stderr (``tearless: error: …``), exit code 1 (2 for a config error): the
explained errors print their own message, and any other exception prints its type and the first line
of its message, with the traceback only under ``TEARLESS_DEBUG=1`` (or ``tearless --debug …``).
SIGTERM (a scheduler's preemption or time limit) is handled like SIGINT: the run stops where it is,
the reward workers and Ray workers are stopped, a Ray cluster this process started is shut down, and
the exit code is 128 + the signal (143 for SIGTERM, 130 for SIGINT); the newest complete checkpoint is
intact and ``trainer.resume_mode=auto`` continues from it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

from tearless import reaper
from tearless.flow.cli import HELPS as FLOW_HELPS

# local imports: --help speed: a command imports only what it runs

DEBUG_ENV = "TEARLESS_DEBUG"


class Stopped(BaseException):
    """SIGTERM or SIGINT arrived; a BaseException like KeyboardInterrupt, so that no ``except
    Exception`` on the way up swallows it, while every ``finally`` (pool, workers, trackers) runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# The run directory of the command once its config is resolved: what a stop message says survives.
_run_dir: list[str] = []
# The reaper of a training command: it ends whatever the run started once this process is gone.
_reaper: list = []
# This process's children from before the command (a caller's own, when main() runs in-process):
# never the command's to end.
_before: set[int] = set()
TRAINING_COMMANDS = ("train", "sft", "dpo")
# The signal that stopped the command, if one did: raised inside C code (Ray's wait), Stopped can
# come back wrapped (SystemError: "returned a result with an exception set"), still a stop.
_received: list[int] = []


def _stop(signum: int, _frame: object) -> None:
    # Once: a second signal during the clean-up would cut the clean-up short.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    _received.append(signum)
    raise Stopped(signum)


@contextlib.contextmanager
def _signals_stop_the_run() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Stopped` in the main thread while the command runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _shutdown_ray() -> None:
    """Shut down Ray if this process joined or started it (its workers and a local cluster end with
    it); without this a signal's exit went through Ray's C++ stack dump and exit code -6."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tearless", description="RL post-training that runs on a laptop CPU.")
    from tearless import __version__

    p.add_argument("--version", action="version", version=f"tearless {__version__}")
    p.add_argument(
        "--debug", action="store_true", help=f"print the traceback of an error (also: {DEBUG_ENV}=1)"
    )
    sub = p.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train", help="run RL training (default: GRPO on the embedded arithmetic task)", add_help=False
    )
    train.add_argument(
        "-h", "--help", action="store_true", help="print the resolved config with each key's doc"
    )
    train.add_argument("--config", help="YAML file merged over the defaults (overrides still win)")
    train.add_argument(
        "--preset",
        help="algorithm preset merged first: ppo, grpo, dr_grpo, dapo, rloo, "
        "reinforce_pp, remax, gspo; task presets: search_r1, countdown, knights_knaves, word_problems, "
        "vlm_count (files in tearless/config/presets/)",
    )
    train.add_argument(
        "--fresh", action="store_true", help="rebuild the embedded task's cached data and model"
    )
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, veRL style")
    show = sub.add_parser("config", help="configuration tools")
    show.add_argument("action", choices=["show"], help="show: print every key, its value and its doc")
    show.add_argument("--config", help="YAML file merged over the defaults")
    show.add_argument(
        "overrides",
        nargs="*",
        help="the command whose keys to show first (train, the default, or sft, dpo, rm), then dotted "
        "key=value overrides",
    )
    _add_data_parser(sub)
    _add_eval_parser(sub)
    _add_offline_parsers(sub)
    _add_report_parsers(sub)
    _add_samples_parser(sub)
    _add_model_parser(sub)
    for name, text in FLOW_HELPS.items():
        cmd = add_config_command(sub, name, text)
        cmd.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. task.name=shapes")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; see the module docs for exit codes, signals and ``TEARLESS_DEBUG``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get(DEBUG_ENV)) or argv[:1] == ["--debug"]
    if argv[:1] == ["--debug"]:
        argv = argv[1:]
    _received.clear()
    _run_dir.clear()
    with _signals_stop_the_run():
        try:
            return _main(argv)
        except Stopped as e:
            return _stopped(e.signum)
        except KeyboardInterrupt as e:
            # SIGINT arrives as Stopped while the command runs, so this one was raised by code the run
            # called (an in-process reward function, reward_model.num_workers=0): say where.
            if _received:
                return _stopped(_received[0])
            if debug:
                raise
            _shutdown_ray()
            print(
                "tearless: error: KeyboardInterrupt raised by the run's own code, not by a signal, "
                f"{_raised_at(e)}; the run stopped (set {DEBUG_ENV}=1 for the traceback)",
                file=sys.stderr,
            )
            return 1
        except Exception as e:
            if _received:
                return _stopped(_received[0])
            if debug:
                raise
            _shutdown_ray()
            print(f"tearless: error: {one_line(e)} (set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
            return 1


def _stopped(signum: int) -> int:
    _shutdown_ray()
    _end_started()
    print(
        f"tearless: stopped by {signal.Signals(signum).name}; the processes it started were stopped "
        f"(reward workers, their samples' processes, Ray). {_what_survives()}",
        file=sys.stderr,
    )
    return 128 + signum


def _end_started() -> None:
    """SIGKILL what this process started and still runs (an in-process reward's subprocesses, say),
    its reaper aside: the pools and Ray have closed by now, so only strays are left."""
    keep = {p.pid for p in _reaper if p is not None} | _before
    for pid in reaper.descendants(os.getpid()) - keep:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _what_survives() -> str:
    """What a stopped or failed run leaves to resume from: its newest complete checkpoint, by name,
    or that none was saved yet (a rerun starts from the beginning)."""
    if not _run_dir:
        return "Any complete checkpoint of the run is intact: rerun with trainer.resume_mode=auto to continue"
    # torch: the run imported it already; --help must not
    from tearless.run.checkpoint import latest_checkpoint

    latest = latest_checkpoint(_run_dir[0])
    if latest is None:
        return f"No checkpoint was saved yet (in {_run_dir[0]}): a rerun starts from the beginning"
    return f"The newest complete checkpoint ({latest}) is intact: trainer.resume_mode=auto continues from it"


def _raised_at(exc: BaseException) -> str:
    """``at <file>, line <n>, in <function>``: the innermost frame of ``exc``'s traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "at an unknown place"
    last = frames[-1]
    return f"at {last.filename}, line {last.lineno}, in {last.name}"


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception's message; when the message carries a traceback of its
    own (a Ray worker's failure), its last line too: the remote exception, the part worth reading."""
    if isinstance(exc, MemoryError):
        return (
            f"MemoryError: out of memory {_raised_at(exc)} (the machine's memory or the process's "
            "address-space limit); lower data.train_batch_size, actor_rollout_ref.actor."
            "ppo_micro_batch_size_per_gpu or data.max_response_length, or free memory"
        )
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        text += f" … {lines[-1]}"
    return text[:1000]


def _main(argv: list[str]) -> int:
    parser = _parser()
    # Overrides may come before and after options (``train a=1 --preset dapo b=2``); argparse leaves
    # the later ones unparsed, so they are collected here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command in TRAINING_COMMANDS:
        _before.clear()
        _before.update(reaper.descendants(os.getpid()))
        if not _reaper:
            # A reward stuck in C code never runs its parent-death handler, and an in-process reward's
            # subprocesses have none: a process outside the run ends them even after a SIGKILL.
            _reaper.append(reaper.start(everything=True))
    if args.command == "data":
        return _data(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "samples":
        return _samples(args)
    if args.command == "model":
        return _model(args)
    if args.command.startswith("flow-"):
        from tearless.flow.cli import run as run_flow

        return run_flow(args)
    if args.command in ("report", "compare"):
        return _report(args)
    if args.command in OFFLINE:
        return _offline(args, args.command)
    if args.command == "config" and args.overrides[:1] and args.overrides[0] in ("train", *OFFLINE):
        name, *args.overrides = args.overrides
        if name in OFFLINE:
            return _offline(args, name)
    from tearless.api import Trainer
    from tearless.config import ConfigError, describe

    overrides = list(args.overrides)
    if getattr(args, "fresh", False):
        overrides.append("task.fresh=true")
    # The CLI is a thin layer over the Python API: the same Trainer, built from the command line.
    trainer = Trainer(args=args.config, overrides=overrides, preset=getattr(args, "preset", None))
    try:
        cfg = trainer.resolved_config()
    except ConfigError as e:
        print(f"tearless: config error: {e}", file=sys.stderr)
        return 2
    _run_dir[:] = [str(cfg.trainer.default_local_dir)]
    if args.command == "config" or getattr(args, "help", False):
        usage = _options_help(parser, args.command) if getattr(args, "help", False) else ""
        print(usage + describe(cfg))
        return 0
    from tearless.config.resume_compat import ResumeMismatch
    from tearless.data.rows import DataError
    from tearless.models.loading import NonFiniteWeights
    from tearless.rewards import RewardError, RewardFunctionError, UnknownDataSource
    from tearless.run.checkpoint import CheckpointError
    from tearless.run.guards import WeightsNotFinite
    from tearless.trainers.rl import TrainingStopped
    from tearless.trainers.runlock import RunLocked
    from tearless.userfiles import UserFileError
    from tearless.workers.ray_group import RayStartError

    explained = (
        DataError, CheckpointError, TrainingStopped, FileNotFoundError, FileExistsError, RunLocked,
        ResumeMismatch, WeightsNotFinite, RewardError, RewardFunctionError, UnknownDataSource, ConfigError,
        UserFileError, NonFiniteWeights, RayStartError,
    )  # fmt: skip
    try:
        summary = trainer.train()
    except explained as e:
        # Bad input and clean stops carry their own explanation; a traceback would only bury it.
        print(f"tearless: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno is None:
            raise
        # The machine refused a write or read (disk full, read-only, permissions): one line, and
        # what survives. Checkpoints are written atomically, so the newest complete one is intact.
        print(
            f"tearless: error: {e}. The run stopped. {_what_survives()} once the cause is fixed",
            file=sys.stderr,
        )
        return 1
    print(format_summary(summary))
    return 0


def format_summary(summary: dict, *, accuracies_only: bool = True, digits: int = 3) -> str:
    """Held-out metrics before vs after (accuracies gain a change in points), where the run lives,
    and its last checkpoint if the summary names one."""
    lines = []
    before, after = summary.get("before", {}), summary.get("after", {})
    for key in sorted(set(before) | set(after)):
        is_accuracy = "/acc/" in key
        if accuracies_only and not is_accuracy:
            continue
        b, a = before.get(key), after.get(key)
        both = a is not None and b is not None
        change = f"  ({(a - b) * 100:+.1f} points)" if is_accuracy and both else ""
        fb = "-" if b is None else f"{b:.{digits}f}"
        fa = "-" if a is None else f"{a:.{digits}f}"
        lines.append(f"{key:<40} before {fb}  after {fa}{change}")
    steps, seconds = summary.get("steps", 0), summary.get("seconds", 0)
    where = f"run directory: {summary['run_dir']} ({steps} steps, {seconds:.0f} s)"
    if not accuracies_only:
        where += f"; checkpoint: {summary.get('checkpoint', '-')}"
    lines.append(where)
    return "\n".join(lines)


def _add_data_parser(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="prepare, generate and inspect datasets")
    actions = data.add_subparsers(dest="data_command", required=True)
    prepare = actions.add_parser(
        "prepare", help="convert GSM8K or MATH (a local copy, or the Hub's) to veRL parquet"
    )
    prepare.add_argument("name", choices=["gsm8k", "math"])
    prepare.add_argument(
        "--input",
        help="a data file, a directory searched recursively, or a Hub dataset ID; left out: the Hub's "
        "openai/gsm8k or DigitalLearningGmbH/MATH-lighteval through the datasets package",
    )
    prepare.add_argument("--output", required=True, help="directory for train.parquet / test.parquet")
    prepare.add_argument("--split", choices=["train", "test"], help="split of inputs whose path says neither")
    make = actions.add_parser("make", help="write an embedded task's train and test parquet files")
    make.add_argument(
        "task",
        help="arithmetic | countdown | knights_knaves | word_problems | reasoning_gym:<task> (any "
        "reasoning-gym task, e.g. reasoning_gym:basic_arithmetic; needs tearless[agents])",
    )
    make.add_argument("--output", required=True, help="directory for train.parquet / test.parquet")
    make.add_argument("--num-train", type=int, default=1000, help="training problems (default 1000)")
    make.add_argument("--num-test", type=int, default=100, help="test problems (default 100)")
    make.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    make.add_argument("--num-people", type=int, help="knights_knaves: inhabitants per puzzle (default 3)")
    make.add_argument(
        "--config",
        type=_json_object,
        help='reasoning_gym:<task>: the task\'s dataset config as JSON, e.g. \'{"operators": ["+"]}\'',
    )
    inspect = actions.add_parser("inspect", help="schema, rows and problems of a dataset file")
    inspect.add_argument("file", help="a .parquet, .jsonl or .json file")
    inspect.add_argument("--tokenizer", help="tokenizer directory: report prompt lengths in tokens")
    inspect.add_argument("--max-prompt-length", type=int, help="flag prompts longer than this (tokens)")
    inspect.add_argument("--rows", type=int, default=3, help="rows to print (default 3)")


def _json_object(text: str) -> dict:
    """``--config``'s value: a JSON object, or one line saying what is wrong with it."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def _data(args: argparse.Namespace) -> int:
    """``tearless data …``: exit 0, or 1 when inspect finds problems, or 2 on bad input."""
    from tearless.data.rows import DataError

    try:
        if args.data_command == "prepare":
            from tearless.data.prepare import prepare

            summary = prepare(args.name, args.input, args.output, split=args.split)
            for split, path in summary["files"].items():
                skipped = summary["skipped"][split]
                note = f" ({skipped} skipped: no answer)" if skipped else ""
                print(f"{path}: {summary['rows'][split]} rows{note}")
            return 0
        if args.data_command == "make":
            from tearless.tasks.make import make_task, train_command

            paths = make_task(
                args.task,
                args.output,
                num_train=args.num_train,
                num_test=args.num_test,
                seed=args.seed,
                num_people=args.num_people,
                config=args.config,
            )
            for split, path in paths.items():
                print(f"{path}: {args.num_train if split == 'train' else args.num_test} rows")
            print(f"train on it with:\n  {train_command(args.task, paths)}")
            return 0
        from tearless.data.inspection import inspect_file

        tokenizer = None
        if args.tokenizer:
            from tearless.models.loading import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer, key="--tokenizer")
        report = inspect_file(
            args.file, tokenizer=tokenizer, max_prompt_length=args.max_prompt_length, num_rows=args.rows
        )
        print(report.text)
        return 1 if report.problems else 0
    except (DataError, FileNotFoundError) as e:
        print(f"tearless: data error: {e}", file=sys.stderr)
        return 2


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval",
        help="score a model or checkpoint on a dataset: greedy accuracy, mean@n, pass@k (as validation)",
        description="Score MODEL (a Hugging Face model directory, or a run's global_step_N checkpoint) on "
        "data.val_files with the reward and validation metrics of training (greedy accuracy and reward; "
        "with actor_rollout_ref.rollout.val_kwargs.do_sample, mean@n and pass@k), and write them as JSON.",
    )
    ev.add_argument("model", metavar="CHECKPOINT_OR_MODEL", help="model directory or global_step_N directory")
    ev.add_argument("--out", default="eval.json", help="JSON file to write (default: eval.json)")
    ev.add_argument("--config", help="YAML file merged over the defaults (overrides still win)")
    ev.add_argument("overrides", nargs="*", help="dotted key=value overrides; data.val_files=… is required")


def _eval(args: argparse.Namespace) -> int:
    """``tearless eval``: the RL trainer's validation of the given model, without a trainer
    (:func:`tearless.trainers.validation.evaluate`); exit 2 on a config error, 1 on bad data."""
    import json
    from pathlib import Path

    from tearless.config import ConfigError, load_config
    from tearless.data.rows import DataError
    from tearless.rewards import RewardError, RewardFunctionError, UnknownDataSource
    from tearless.trainers.validation import evaluate

    model = Path(args.model)
    if (model / "actor" / "config.json").is_file():  # a checkpoint: its HF model is global_step_N/actor
        model = model / "actor"
    given = {item.split("=", 1)[0].lstrip("+") for item in args.overrides}
    if "data.val_files" not in given:
        print(
            "tearless: config error: tearless eval needs data.val_files=FILE (the dataset to score)",
            file=sys.stderr,
        )
        return 2
    val_files = next(
        x.split("=", 1)[1] for x in args.overrides if x.lstrip("+").startswith("data.val_files=")
    )
    # The RL config asks for both files or neither (the embedded task's); eval reads only the val files.
    train_files = [] if "data.train_files" in given else [f"data.train_files={val_files}"]
    try:
        overrides = [f"actor_rollout_ref.model.path={model}", *train_files, *args.overrides]
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"tearless: config error: {e}", file=sys.stderr)
        return 2
    try:
        metrics = evaluate(cfg, log=lambda _: None)
    except (DataError, FileNotFoundError, RewardError, RewardFunctionError, UnknownDataSource) as e:
        print(f"tearless: error: {e}", file=sys.stderr)
        return 1
    result = {"model": str(model), "data": val_files, "metrics": metrics}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for key in sorted(metrics):
        print(f"{key:<40} {metrics[key]:.4f}")
    print(f"written: {args.out}")
    return 0


def add_config_command(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand driven by a config schema: ``-h`` prints the resolved config with each key's doc,
    ``--config`` merges a YAML file; the caller adds its own options and the overrides."""
    cmd = sub.add_parser(name, help=text, add_help=False)
    cmd.add_argument(
        "-h", "--help", action="store_true", help="print the resolved config with each key's doc"
    )
    cmd.add_argument("--config", help="YAML file merged over the defaults (overrides still win)")
    return cmd


OFFLINE = ("sft", "dpo", "rm")


def _add_offline_parsers(sub: argparse._SubParsersAction) -> None:
    helps = {
        "sft": "supervised fine-tuning, loss on assistant tokens (default: the embedded task's warm-up)",
        "dpo": "offline DPO on preference pairs (default: pairs from the embedded task's warm-up model)",
        "rm": "train a Bradley-Terry reward model on preference pairs (the files dpo reads; default: "
        "the embedded task's pairs); its checkpoints' reward_model/ is what reward_model.model.path takes",
    }
    for name, text in helps.items():
        cmd = add_config_command(sub, name, text)
        if name in ("dpo", "rm"):
            cmd.add_argument(
                "--fresh", action="store_true", help="rebuild the embedded task and its preference pairs"
            )
        cmd.add_argument("overrides", nargs="*", help="dotted key=value overrides")


def _offline(args: argparse.Namespace, command: str) -> int:
    """``tearless sft`` / ``dpo`` / ``rm``: train, print held-out metrics before/after; exit 2 on a
    config error. From ``tearless config show <command>``: print the config only."""
    from tearless.config import ConfigError, describe, load_config

    if command == "sft":
        from tearless.config.sft import SFTConfig as schema
    elif command == "dpo":
        from tearless.config.dpo import DPOConfig as schema
    else:
        from tearless.config.rm import RMConfig as schema
    overrides = [*args.overrides, *(["task.fresh=true"] if getattr(args, "fresh", False) else [])]
    try:
        cfg = load_config(args.config, overrides, schema=schema)
    except ConfigError as e:
        print(f"tearless: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "config" or args.help:
        print((_options_help(_parser(), command) if args.command != "config" else "") + describe(cfg))
        return 0
    from tearless.data.rows import DataError
    from tearless.run.checkpoint import CheckpointError

    if command == "sft":
        from tearless.trainers.sft import SFTTrainer as trainer
    elif command == "dpo":
        from tearless.trainers.dpo import DPOTrainer as trainer
    else:
        from tearless.trainers.rm import RewardModelTrainer as trainer
    from tearless.rewards import RewardFunctionError

    try:
        summary = trainer(cfg).fit()
    except (DataError, CheckpointError, FileNotFoundError, FileExistsError, RewardFunctionError) as e:
        # Bad data files or rows: the message names the file, row and fix; a traceback would bury it.
        print(f"tearless: error: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary, accuracies_only=False, digits=4))
    if "reward_model" in summary:
        print(f"reward model: reward_model.model.path={summary['reward_model']}")
    return 0


def _options_help(parser: argparse.ArgumentParser, command: str) -> str:
    """The command's usage and options (``--preset``, ``--config``, ``--fresh``…), then a heading for
    the config keys that follow."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if command not in sub.choices:
        return ""
    return sub.choices[command].format_help() + "\nconfig keys (key = value, then its doc):\n"


def _add_report_parsers(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="HTML report of a run: plots and a written diagnosis")
    report.add_argument("run_dir", help="the run directory (trainer.default_local_dir)")
    report.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html)")
    comp = sub.add_parser("compare", help="HTML page overlaying the metrics of several runs")
    comp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to overlay")
    comp.add_argument("--out", default="compare.html", help="HTML file to write (default: compare.html)")


def _report(args: argparse.Namespace) -> int:
    """``tearless report`` / ``tearless compare``: write the page, print its path; exit 2 on a
    directory that is not a run."""
    from tearless.report.html import RunDirError, compare, write_report

    def warn(message: str) -> None:
        print(f"tearless: warning: {message}", file=sys.stderr)

    try:
        if args.command == "report":
            page = write_report(args.run_dir, args.out, log=warn)
        else:
            page = compare(args.run_dirs, args.out, log=warn)
    except RunDirError as e:
        print(f"tearless: {e}", file=sys.stderr)
        return 2
    print(page)
    return 0


def _add_samples_parser(sub: argparse._SubParsersAction) -> None:
    samples = sub.add_parser("samples", help="print a run's rollout samples (rollouts.jsonl.gz)")
    samples.add_argument("run_dir", help="the run directory (trainer.default_local_dir)")
    samples.add_argument("--step", type=int, help="only this step (default: every step)")
    pick = samples.add_mutually_exclusive_group()
    pick.add_argument("--worst", type=int, metavar="K", help="the K lowest-scored samples, lowest first")
    pick.add_argument("--best", type=int, metavar="K", help="the K highest-scored samples, highest first")
    samples.add_argument(
        "--grep", metavar="TEXT", help="only samples whose prompt, response or answer has TEXT"
    )
    samples.add_argument("--source", metavar="DS", help="only samples of this data_source")


def _samples(args: argparse.Namespace) -> int:
    from tearless.samples import samples_command

    return samples_command(
        args.run_dir, step=args.step, worst=args.worst, best=args.best, grep=args.grep, source=args.source
    )


def _add_model_parser(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model tools: import a GGUF file as a model directory")
    actions = model.add_subparsers(dest="model_command", required=True)
    imp = actions.add_parser(
        "import-gguf",
        help="write a GGUF file's model and tokenizer as a float32 save_pretrained directory",
        description="Dequantise GGUF_FILE (llama.cpp's format; needs the gguf package) into OUTPUT_DIR, a "
        "plain Hugging Face model directory that every tearless command takes as model.path.",
    )
    imp.add_argument("gguf_file", metavar="GGUF_FILE")
    imp.add_argument("output_dir", metavar="OUTPUT_DIR")
    imp.add_argument(
        "--hub-id",
        metavar="ORG/NAME",
        help="also put the directory in the Hugging Face cache under this ID (for machines without "
        "network: ORG/NAME then resolves offline)",
    )


def _model(args: argparse.Namespace) -> int:
    """``tearless model import-gguf``: exit 0, or 2 on a file that cannot be imported."""
    from tearless.models.gguf import GGUFImportError, import_gguf
    from tearless.models.hub import add_to_hub_cache

    try:
        out = import_gguf(args.gguf_file, args.output_dir)
    except GGUFImportError as e:
        print(f"tearless: error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: model and tokenizer written (float32 safetensors)")
    if args.hub_id:
        print(f"{add_to_hub_cache(out, args.hub_id)}: cached as {args.hub_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

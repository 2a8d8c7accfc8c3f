"""``tearless <command> key=value …``: the command-line interface.

Commands: ``train`` (RL training, veRL-style dotted overrides), ``config show`` (every key with its
value and documentation). Heavy imports happen inside the commands so ``tearless --help`` is quick.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tearless", description="RL post-training that runs on a laptop CPU.")
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
        "reinforce_pp, remax, gspo (files in tearless/config/presets/)",
    )
    train.add_argument(
        "--fresh", action="store_true", help="rebuild the embedded task's cached data and model"
    )
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, veRL style")
    show = sub.add_parser("config", help="configuration tools")
    show.add_argument("action", choices=["show"], help="show: print every key, its value and its doc")
    show.add_argument("--config", help="YAML file merged over the defaults")
    show.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from tearless.config import ConfigError, describe, load_config

    overrides = list(args.overrides)
    if getattr(args, "fresh", False):
        overrides.append("task.fresh=true")
    try:
        cfg = load_config(args.config, overrides, preset=getattr(args, "preset", None))
    except ConfigError as e:
        print(f"tearless: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "config" or getattr(args, "help", False):
        print(describe(cfg))
        return 0
    from tearless.trainers.rl import RLTrainer

    summary = RLTrainer(cfg).fit()
    print(format_summary(summary))
    return 0


def format_summary(summary: dict) -> str:
    """Held-out accuracy before vs after, and where the run lives."""
    lines = []
    before, after = summary.get("before", {}), summary.get("after", {})
    for key in sorted(set(before) | set(after)):
        if "/acc/" in key:
            b, a = before.get(key), after.get(key)
            change = f"  ({(a - b) * 100:+.1f} points)" if a is not None and b is not None else ""
            fb = "-" if b is None else f"{b:.3f}"
            fa = "-" if a is None else f"{a:.3f}"
            lines.append(f"{key:<40} before {fb}  after {fa}{change}")
    lines.append(
        f"run directory: {summary['run_dir']} ({summary.get('steps', 0)} steps, "
        f"{summary.get('seconds', 0):.0f} s)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

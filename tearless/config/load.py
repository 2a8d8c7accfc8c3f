"""Building a config: defaults, a YAML file, a dict and dotted overrides, then validation.

Everything here runs before any model is loaded, so a typo or an impossible batch size costs the
user a second, not a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tearless.config.device import describe_device_defaults, device_config_defaults, run_device
from tearless.config.errors import ConfigError
from tearless.config.identity import default_experiment_name
from tearless.config.schema import Config, all_keys
from tearless.config.user_model import MODEL_KEY, describe_applied, explicit_keys, user_model_defaults
from tearless.config.validate import validate
from tearless.config.verl_compat import Refused, rules_for, translate

# Keys veRL's docs write where its code does not read them: the error names the key that works.
MISPLACED_KEYS = {
    f"actor_rollout_ref.actor.policy_loss.{tau}": (
        f"actor_rollout_ref.actor.{tau}",
        "veRL's SAPO README writes policy_loss.tau_*, but its code reads actor.tau_*",
    )
    for tau in ("tau_pos", "tau_neg")
}


def _explain(err: OmegaConfBaseException, source: str, schema: type = Config) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    msg = str(err).splitlines()[0]
    if schema is Config and key in MISPLACED_KEYS:
        right, why = MISPLACED_KEYS[key]
        return ConfigError(f"unknown config key {key!r} (from {source}). Did you mean {right}? ({why})")
    if "not in" in msg or ("Key '" in msg and "not" in msg):
        known = [k for k, _ in all_keys(schema)]
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        section = key.rsplit(".", 1)[0] if "." in key else ""
        siblings = (
            sorted({k.split(".")[-1] for k in known if k.rsplit(".", 1)[0] == section}) if section else []
        )
        more = f" Keys under {section}: {', '.join(siblings)}." if siblings and not close else ""
        return ConfigError(
            f"unknown config key {key!r} (from {source}).{hint}{more} `tearless config show` lists every key."
        )
    return ConfigError(f"config key {key!r} (from {source}): {msg}")


def _container_clash(base: Any, layer: Any, source: str) -> ConfigError | None:
    """The error for a layer that puts a list where the config has a section or dict (or the reverse):
    OmegaConf's own TypeError does not say which key."""

    def find(b: Any, l: Any, prefix: str) -> tuple[str, Any, Any] | None:
        for key, value in l.items():
            if key not in b:
                continue
            here, default = f"{prefix}{key}", b[key]
            if isinstance(default, dict) != isinstance(value, dict) and (
                isinstance(default, (dict, list)) or isinstance(value, (dict, list))
            ):
                return here, default, value
            if isinstance(default, dict) and isinstance(value, dict):
                found = find(default, value, here + ".")
                if found:
                    return found
        return None

    plain_base = OmegaConf.to_container(base, resolve=False)
    plain_layer = OmegaConf.to_container(layer, resolve=False)
    found = find(plain_base, plain_layer, "") if isinstance(plain_layer, dict) else None
    if found is None:
        return None
    key, default, value = found
    want = "a section of keys" if isinstance(default, dict) else "a list"
    return ConfigError(
        f"config key {key!r} (from {source}) must be {want} (like {default!r:.60}), got {value!r:.60}"
    )


def _keys_of(schema: type) -> tuple[frozenset[str], frozenset[str]]:
    """The schema's keys and its sections (every proper prefix of a key)."""
    keys = frozenset(k for k, _ in all_keys(schema))
    sections = frozenset(k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1))
    return keys, sections


def _from_verl(layer: Any, source: str, schema: type, notify: Callable[[str], None] | None) -> Any:
    """One config layer with veRL-only keys translated (tearless.config.verl_compat) and a single
    ``trainer.logger`` name made a list."""
    tree = OmegaConf.to_container(layer, resolve=False)
    if not isinstance(tree, dict):
        return layer
    trainer = tree.get("trainer")
    if isinstance(trainer, dict) and isinstance(trainer.get("logger"), str):
        trainer["logger"] = [trainer["logger"]]
    keys, sections = _keys_of(schema)

    def known(key: str) -> str | None:
        return "leaf" if key in keys else "section" if key in sections else None

    say = notify or (lambda text: print(f"tearless: note: {text}", file=sys.stderr))
    try:
        return OmegaConf.create(translate(tree, known, source, say, rules_for(schema.__name__)))
    except Refused as e:
        raise ConfigError(str(e)) from e


def _dotlist(overrides: Iterable[str]) -> list[str]:
    items = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. data.train_batch_size=16)")
        items.append(item[1:] if item.startswith("+") else item)
    return items


PRESETS_DIR = Path(__file__).parent / "presets"


def presets() -> list[str]:
    """Names of the algorithm presets shipped with tearless (``tearless train --preset NAME``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``; a clear error lists the presets if there is no such one."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(presets())}")
    return path


def load_config(
    config: Any = None,
    overrides: Iterable[str] = (),
    *,
    preset: str | None = None,
    validate_config: bool = True,
    schema: type = Config,
    notify: Callable[[str], None] | None = None,
    device: str | None = None,
) -> Any:
    """Merge the defaults with ``config`` (a :class:`Config`, a dict, or a YAML path) and ``overrides``.

    ``preset`` (a name from :func:`presets`) is merged first, then ``config``, then ``overrides``.
    ``schema`` is the dataclass of the command's config (the RL trainer's :class:`Config` by default;
    other trainers pass theirs). A schema with a ``validate()`` method has it called after merging.

    ``overrides`` are dotted ``key=value`` strings, veRL style. Unknown keys, wrong types and
    impossible combinations raise :class:`ConfigError` naming the key and the fix. veRL keys that
    tearless has no field for follow :mod:`tearless.config.verl_compat`: taken by their tearless
    equivalent, accepted with a one-line note passed to ``notify`` (default: printed to stderr), or
    refused. ``trainer.logger`` may be one name (``console``), as veRL's scripts write it.

    The RL config's keys whose default depends on the device (:mod:`tearless.config.device`) take the
    defaults of ``device`` (``"cpu"`` or ``"cuda"``; None = ``trainer.device`` as this process sees
    it) where no layer set them.
    """
    merged = OmegaConf.structured(schema)
    layers = [
        (_from_verl(layer, source, schema, notify), source)
        for layer, source in _layers(config, overrides, preset, schema)
    ]
    for layer, source in layers:
        try:
            merged = OmegaConf.merge(merged, layer)
        except (OmegaConfBaseException, TypeError) as e:
            # A list where a section or dict belongs (or the reverse) comes as a TypeError, or an
            # OmegaConf error, without the key in it.
            clash = None if getattr(e, "full_key", None) else _container_clash(merged, layer, source)
            if clash is not None:
                raise clash from e
            if isinstance(e, TypeError):
                raise ConfigError(f"{source} does not fit the config's structure: {e}") from e
            raise _explain(e, source, schema) from e
    _apply_user_model_defaults(merged, [layer for layer, _ in layers], schema, notify)
    if schema is Config:
        _apply_device_defaults(merged, [layer for layer, _ in layers], device, notify)
    if schema is Config and merged.trainer.experiment_name is None:
        # Derived from the model, data and estimator, so that different runs get different directories.
        merged.trainer.experiment_name = default_experiment_name(
            OmegaConf.to_container(merged, resolve=False)
        )
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _explain(e, "the merged config", schema) from e
    assert isinstance(cfg, schema)
    if validate_config:
        if schema is Config:
            validate(cfg)
        elif hasattr(cfg, "validate"):
            cfg.validate()
    return cfg


def _layers(config: Any, overrides: Iterable[str], preset: str | None, schema: type) -> list[tuple[Any, str]]:
    """The layers :func:`load_config` merges over the defaults, in order, each with where it came from."""
    layers: list[tuple[Any, str]] = []
    if preset is not None:
        layers.append((OmegaConf.load(preset_path(preset)), f"preset {preset!r}"))
    if isinstance(config, schema):
        layers.append((OmegaConf.structured(config), f"the {schema.__name__} object"))
    elif isinstance(config, Mapping):
        layers.append((OmegaConf.create(dict(config)), "the config dict"))
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            layers.append((OmegaConf.load(path), str(path)))
        except Exception as e:  # a YAML syntax error names the line itself
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    elif config is not None:
        raise ConfigError(
            f"config must be a {schema.__name__}, a dict or a YAML path, not {type(config).__name__}"
        )
    dotlist = _dotlist(overrides)
    for item in dotlist:
        try:
            layers.append((OmegaConf.from_dotlist([item]), f"override {item!r}"))
        except Exception as e:  # OmegaConf's errors, and YAML's own (a control character, say)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"override {item!r} cannot be parsed: {first}") from e
    return layers


def _apply_user_model_defaults(
    merged: Any, layers: list[Any], schema: type, notify: Callable[[str], None] | None
) -> None:
    """Peer defaults for a pretrained model's keys that no layer set (tearless.config.user_model),
    announced in one note line."""
    tree = OmegaConf.to_container(merged, resolve=False)
    explicit = explicit_keys(OmegaConf.to_container(layer, resolve=False) for layer in layers)
    changes = {}
    for key, value in user_model_defaults(schema.__name__, tree, explicit).items():
        changes[key] = (value, OmegaConf.select(merged, key))
        OmegaConf.update(merged, key, value)
    if changes:
        say = notify or (lambda text: print(f"tearless: note: {text}", file=sys.stderr))
        say(describe_applied(MODEL_KEY[schema.__name__], changes))


def _apply_device_defaults(
    merged: Any, layers: list[Any], device: str | None, notify: Callable[[str], None] | None
) -> None:
    """The device's defaults for the keys no layer set (tearless.config.device), announced in one
    note line when any applies (never on CPU, whose defaults are the schema's); the device is the
    driver's (:func:`run_device`)."""
    device = device or run_device(merged.trainer.device)
    tree = OmegaConf.to_container(merged, resolve=False)
    explicit = explicit_keys(OmegaConf.to_container(layer, resolve=False) for layer in layers)
    changes = {}
    for key, value in device_config_defaults(device, tree, explicit).items():
        changes[key] = (value, OmegaConf.select(merged, key))
        OmegaConf.update(merged, key, value)
    if changes:
        say = notify or (lambda text: print(f"tearless: note: {text}", file=sys.stderr))
        say(describe_device_defaults(device, changes))


def to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (for YAML dumps and loggers)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def describe(cfg: Any = None) -> str:
    """Every key with its current value and its documentation line, one per line."""
    cfg = cfg if cfg is not None else Config()
    lines = []
    for key, f in all_keys(type(cfg)):
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        lines.append(f"{key} = {value!r}\n    {f.metadata.get('help', '')}")
    return "\n".join(lines)

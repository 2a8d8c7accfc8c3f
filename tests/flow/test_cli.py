import json

import pytest

from tearless.cli import main


def test_flow_help_lists_the_keys(capsys):
    assert main(["flow-train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "train.clip_range = 0.01" in out and "sample.noise_level = 0.7" in out


def test_flow_config_error_names_the_key(capsys):
    assert main(["flow-train", "train.clip_rnage=0.1"]) == 2
    assert "Did you mean train.clip_range" in capsys.readouterr().err
    assert main(["flow-pretrain", "task.name=mnist"]) == 2
    assert "task.name" in capsys.readouterr().err


def test_flow_timesteps_as_one_number_is_a_config_error(capsys):
    # train.timesteps=2 used to end in "TypeError: 'int' object is not iterable"
    assert main(["flow-train", "train.timesteps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tearless: config error: train.timesteps: 2 is not a list")


@pytest.mark.slow
def test_flow_pretrain_then_train_from_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEARLESS_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    assert main(["flow-pretrain", "pretrain.steps=30", f"pretrain.output_dir={base}"]) == 0
    info = json.loads((base / "flow_model.json").read_text())
    assert info["task"] == "points2d" and info["pretrain"]["steps"] == 30
    assert (
        main(
            [
                "flow-train",
                f"model.path={base}",
                "train.epochs=2",
                "sample.eval_samples_per_prompt=8",
                f"trainer.default_local_dir={tmp_path / 'run'}",
                "trainer.logger=[jsonl]",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "val/reward" in out and "global_step_2" in out
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 1, 2]
    # A model of another task is refused with the fix in the message.
    assert main(["flow-train", f"model.path={base}", "task.name=shapes"]) == 2
    assert "holds a model of task 'points2d'" in capsys.readouterr().err
    assert main(["flow-train", f"model.path={tmp_path}"]) == 2
    assert "no flow_model.json" in capsys.readouterr().err

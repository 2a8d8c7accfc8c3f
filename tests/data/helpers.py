def make_row(content="1+2=", ground_truth="3", **extra):
    """A valid veRL-schema row; keyword arguments add or replace columns."""
    row = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train"},
    }
    row.update(extra)
    return row

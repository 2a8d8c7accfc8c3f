"""tearless: RL post-training that runs on a laptop CPU and scales out."""

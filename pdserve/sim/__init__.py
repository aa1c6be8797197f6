"""Running the real control plane without a model: a fake executor and a manual clock (pure Python)."""

"""The frameworks a stage runs in (torch, NumPy), and torch's side of models, tensors, checkpoints and profiles."""

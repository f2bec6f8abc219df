"""A stage during training: the action loop, the executor, its links, guards, reduce overlap, the step and the outer step."""
